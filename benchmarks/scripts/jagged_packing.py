"""
Masked-token pretraining of a small encoder on variable-length sequences, without padding.

Follows the PyTorch tutorials "Getting Started with Nested Tensors" and "Accelerating PyTorch
Transformers by replacing nn.Transformer with Nested Tensors and torch.compile()": a batch of
sequences of different lengths is one nested tensor with the jagged layout (NJT), the packed
q/k/v projection, LayerNorm and the MLP run on its values, and F.scaled_dot_product_attention
takes the NJTs directly (flash / memory-efficient attention with cu_seqlens on CUDA). Only the
loss pads: logits go back to a dense (B, max_len, V) tensor with to_padded_tensor.

    python jagged_packing.py --batch-size 32 --max-len 1024 --d-model 1024 --nheads 16 --layers 12
"""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--nheads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--mask-prob", type=float, default=0.15)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--no-amp", action="store_true", help="train in fp32 instead of bf16 autocast")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class MultiHeadAttention(nn.Module):
    """Multi-head attention that accepts NJT (or dense) inputs of shape (N, L_t, E_q), as in the tutorial."""

    def __init__(self, E_q, E_k, E_v, E_total, nheads, dropout=0.0, bias=True, device=None, dtype=None):
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.nheads = nheads
        self.dropout = dropout
        self._qkv_same_embed_dim = E_q == E_k and E_q == E_v
        if self._qkv_same_embed_dim:
            self.packed_proj = nn.Linear(E_q, E_total * 3, bias=bias, **factory_kwargs)
        else:
            self.q_proj = nn.Linear(E_q, E_total, bias=bias, **factory_kwargs)
            self.k_proj = nn.Linear(E_k, E_total, bias=bias, **factory_kwargs)
            self.v_proj = nn.Linear(E_v, E_total, bias=bias, **factory_kwargs)
        E_out = E_q
        self.out_proj = nn.Linear(E_total, E_out, bias=bias, **factory_kwargs)
        assert E_total % nheads == 0, "Embedding dim is not divisible by nheads"
        self.E_head = E_total // nheads
        self.bias = bias

    def forward(self, query, key, value, attn_mask=None, is_causal=False):
        # Step 1. Apply input projection
        if self._qkv_same_embed_dim:
            if query is key and key is value:
                result = self.packed_proj(query)
                query, key, value = torch.chunk(result, 3, dim=-1)
            else:
                q_weight, k_weight, v_weight = torch.chunk(self.packed_proj.weight, 3, dim=0)
                if self.bias:
                    q_bias, k_bias, v_bias = torch.chunk(self.packed_proj.bias, 3, dim=0)
                else:
                    q_bias, k_bias, v_bias = None, None, None
                query, key, value = (F.linear(query, q_weight, q_bias), F.linear(key, k_weight, k_bias),
                                     F.linear(value, v_weight, v_bias))
        else:
            query = self.q_proj(query)
            key = self.k_proj(key)
            value = self.v_proj(value)

        # The math fallback (CPU) wants each of q/k/v contiguous after the head transpose;
        # flash / memory-efficient attention on CUDA read the chunks of the packed projection as they are.
        if not query.is_cuda:
            query, key, value = query.contiguous(), key.contiguous(), value.contiguous()

        # Step 2. Split heads and prepare for SDPA
        # (N, L_t, E_total) -> (N, L_t, nheads, E_head) -> (N, nheads, L_t, E_head)
        query = query.unflatten(-1, [self.nheads, self.E_head]).transpose(1, 2)
        key = key.unflatten(-1, [self.nheads, self.E_head]).transpose(1, 2)
        value = value.unflatten(-1, [self.nheads, self.E_head]).transpose(1, 2)

        # Step 3. Run SDPA
        # (N, nheads, L_t, E_head)
        attn_output = F.scaled_dot_product_attention(
            query, key, value, dropout_p=self.dropout if self.training else 0.0, is_causal=is_causal)
        # (N, nheads, L_t, E_head) -> (N, L_t, nheads, E_head) -> (N, L_t, E_total)
        attn_output = attn_output.transpose(1, 2).flatten(-2)

        # Step 4. Apply output projection
        # (N, L_t, E_total) -> (N, L_t, E_out)
        attn_output = self.out_proj(attn_output)
        return attn_output


class TransformerEncoderLayer(nn.Module):
    """Pre-norm encoder layer (the tutorial's nn.TransformerEncoderLayer replacement)."""

    def __init__(self, d_model, nhead, dim_feedforward, dropout=0.0, layer_norm_eps=1e-5, bias=True):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, d_model, d_model, d_model, nhead, dropout=dropout, bias=bias)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, src, is_causal=False):
        x = self.norm1(src)
        src = src + self.dropout(self.self_attn(x, x, x, is_causal=is_causal))
        src = src + self.dropout(self.linear2(F.gelu(self.linear1(self.norm2(src)))))
        return src


class JaggedEncoderMLM(nn.Module):
    def __init__(self, vocab_size, d_model, nheads, layers, max_len, dropout=0.0):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.layers = nn.ModuleList(
            [TransformerEncoderLayer(d_model, nheads, 4 * d_model, dropout=dropout) for _ in range(layers)])
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied, as in BERT
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens, positions):
        # tokens, positions: NJTs of shape (B, j1); embedding runs on their values
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))  # NJT (B, j1, V)


def random_batch(args, device, mask_id):
    """A list of variable-length sequences, BERT-style 80/10/10 masking, as NJTs."""
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.batch_size,)).tolist()
    inputs, targets, positions = [], [], []
    for n in lengths:
        seq = torch.randint(1, args.vocab_size, (n,))
        tgt = torch.full((n,), -100)
        chosen = torch.rand(n) < args.mask_prob
        tgt[chosen] = seq[chosen]
        replace = chosen & (torch.rand(n) < 0.8)
        seq = seq.masked_fill(replace, mask_id)
        inputs.append(seq)
        targets.append(tgt)
        positions.append(torch.arange(n))
    as_njt = lambda ts: torch.nested.nested_tensor(ts, layout=torch.jagged, device=device)
    tokens = as_njt(inputs)
    # positions share the tokens' offsets (same ragged dim), so the two embeddings can be added
    positions = torch.nested.nested_tensor_from_jagged(torch.cat(positions).to(device), offsets=tokens.offsets())
    return tokens, positions, as_njt(targets), sum(lengths)


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_amp = not args.no_amp
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    model = JaggedEncoderMLM(args.vocab_size, args.d_model, args.nheads, args.layers, args.max_len,
                             dropout=args.dropout).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f}M parameters on {device}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 2) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    mask_id = 0

    model.train()
    for step in range(args.steps):
        t0 = time.perf_counter()
        tokens, positions, targets, n_tokens = random_batch(args, device, mask_id)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_amp):
            logits = model(tokens, positions)
            # pad only for the loss: (B, max_len, V) logits, padding ignored via -100 targets
            padded_logits = logits.to_padded_tensor(0.0)
            padded_targets = targets.to_padded_tensor(-100)
            loss = F.cross_entropy(padded_logits.flatten(0, 1).float(), padded_targets.flatten(),
                                   ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        n_masked = int((padded_targets != -100).sum())
        print(f"step {step}: loss {loss.item():.4f} | grad norm {grad_norm.item():.3f} | "
              f"{n_tokens} tokens ({n_masked} masked), padded to {tuple(padded_targets.shape)} | {dt * 1000:.0f} ms")

    if device.type == "cuda":
        print(f"max memory allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB, "
              f"reserved {torch.cuda.max_memory_reserved() / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
