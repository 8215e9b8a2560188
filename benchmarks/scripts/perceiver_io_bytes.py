"""Perceiver IO masked language modelling on raw UTF-8 bytes (deepmind/perceiver "language" config as re-implemented in PyTorch by krasserm/perceiver-io and lucidrains/perceiver-pytorch): a learned latent array, one cross-attention from the latents to a long padded byte sequence with nn.MultiheadAttention(batch_first=True, kdim/vdim != embed_dim) and a key_padding_mask built from per-sample lengths, a stack of nn.TransformerEncoderLayer(norm_first=True, batch_first=True) latent self-attention blocks, learned output queries decoding back to every byte position, fp16 torch.autocast + torch.amp.GradScaler("cuda"), optimizer.zero_grad(set_to_none=True), a hand-written LAMB (or AdamW) with no decay on norms/biases/embeddings, and a linear-warm-up cosine LambdaLR."""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim import Optimizer

# byte vocabulary: 256 byte values shifted by the special tokens, as in the Perceiver IO byte tokenizer
PAD_ID, BOS_ID, EOS_ID, MASK_ID, CLS_ID, SEP_ID = 0, 1, 2, 3, 4, 5
NUM_SPECIAL = 6
VOCAB_SIZE = 256 + NUM_SPECIAL


def get_args():
    p = argparse.ArgumentParser("Perceiver IO byte-level MLM")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--num-latents", type=int, default=256)
    p.add_argument("--num-latent-channels", type=int, default=1024)
    p.add_argument("--num-input-channels", type=int, default=768)
    p.add_argument("--num-self-attention-layers", type=int, default=16)
    p.add_argument("--num-cross-attention-heads", type=int, default=8)
    p.add_argument("--num-self-attention-heads", type=int, default=8)
    p.add_argument("--widening-factor", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--mask-prob", type=float, default=0.15)
    p.add_argument("--optimizer", choices=["lamb", "adamw"], default="lamb")
    p.add_argument("--lr", type=float, default=1.25e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=1000)
    p.add_argument("--max-steps", type=int, default=500_000)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------
class MLP(nn.Sequential):
    def __init__(self, num_channels, widening_factor, dropout):
        super().__init__(
            nn.LayerNorm(num_channels),
            nn.Linear(num_channels, widening_factor * num_channels),
            nn.GELU(),
            nn.Linear(widening_factor * num_channels, num_channels),
            nn.Dropout(dropout),
        )


class CrossAttentionLayer(nn.Module):
    """Pre-norm cross-attention + MLP, queries attend to a (longer) key/value sequence."""

    def __init__(self, num_q_channels, num_kv_channels, num_heads, widening_factor, dropout, need_weights=False):
        super().__init__()
        self.q_norm = nn.LayerNorm(num_q_channels)
        self.kv_norm = nn.LayerNorm(num_kv_channels)
        self.attention = nn.MultiheadAttention(
            embed_dim=num_q_channels,
            num_heads=num_heads,
            kdim=num_kv_channels,
            vdim=num_kv_channels,
            dropout=dropout,
            batch_first=True,
        )
        self.dropout = nn.Dropout(dropout)
        self.mlp = MLP(num_q_channels, widening_factor, dropout)
        self.need_weights = need_weights

    def forward(self, x_q, x_kv, pad_mask=None):
        q = self.q_norm(x_q)
        kv = self.kv_norm(x_kv)
        attn_out, _ = self.attention(q, kv, kv, key_padding_mask=pad_mask, need_weights=self.need_weights)
        x = x_q + self.dropout(attn_out)
        return x + self.mlp(x)


class InputAdapter(nn.Module):
    """Token embedding + learned absolute position embedding (TextInputAdapter)."""

    def __init__(self, vocab_size, max_seq_len, num_input_channels):
        super().__init__()
        self.txt_embedding = nn.Embedding(vocab_size, num_input_channels)
        self.pos_embedding = nn.Parameter(torch.empty(max_seq_len, num_input_channels))
        with torch.no_grad():
            self.txt_embedding.weight.normal_(0.0, 0.02)
            self.pos_embedding.uniform_(-0.5, 0.5)

    def forward(self, x):
        b, l = x.shape
        return self.txt_embedding(x) + self.pos_embedding[:l]


class PerceiverEncoder(nn.Module):
    def __init__(self, input_adapter, num_latents, num_latent_channels, num_input_channels,
                 num_cross_attention_heads, num_self_attention_heads, num_self_attention_layers,
                 widening_factor, dropout):
        super().__init__()
        self.input_adapter = input_adapter
        self.latent = nn.Parameter(torch.empty(num_latents, num_latent_channels))
        with torch.no_grad():
            self.latent.normal_(0.0, 0.02).clamp_(-2.0, 2.0)
        self.cross_attn = CrossAttentionLayer(
            num_latent_channels, num_input_channels, num_cross_attention_heads, widening_factor, dropout)
        self.self_attn = nn.ModuleList([
            nn.TransformerEncoderLayer(
                d_model=num_latent_channels,
                nhead=num_self_attention_heads,
                dim_feedforward=widening_factor * num_latent_channels,
                dropout=dropout,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(num_self_attention_layers)
        ])

    def forward(self, x, pad_mask=None):
        b, *_ = x.shape
        x = self.input_adapter(x)
        # repeat the learned latent array across the batch: (b, n, d)
        x_latent = self.latent.unsqueeze(0).expand(b, -1, -1)
        x_latent = self.cross_attn(x_latent, x, pad_mask=pad_mask)
        for layer in self.self_attn:
            x_latent = layer(x_latent)
        return x_latent


class PerceiverDecoder(nn.Module):
    """Output queries (one learned vector per output position) cross-attend to the latents."""

    def __init__(self, max_seq_len, num_output_query_channels, num_latent_channels, vocab_size,
                 num_cross_attention_heads, widening_factor, dropout):
        super().__init__()
        self.output_query = nn.Parameter(torch.empty(max_seq_len, num_output_query_channels))
        with torch.no_grad():
            self.output_query.normal_(0.0, 0.02).clamp_(-2.0, 2.0)
        # decoder cross-attention left at the nn.MultiheadAttention default need_weights=True
        self.cross_attn = CrossAttentionLayer(
            num_output_query_channels, num_latent_channels, num_cross_attention_heads, widening_factor, dropout,
            need_weights=True)
        self.output_adapter = nn.Linear(num_output_query_channels, vocab_size)

    def forward(self, x_latent, seq_len):
        b = x_latent.shape[0]
        q = self.output_query[:seq_len].unsqueeze(0).expand(b, -1, -1)
        x = self.cross_attn(q, x_latent)
        return self.output_adapter(x)


class PerceiverIO(nn.Module):
    def __init__(self, encoder, decoder):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder

    def forward(self, x, pad_mask=None):
        x_latent = self.encoder(x, pad_mask=pad_mask)
        return self.decoder(x_latent, seq_len=x.shape[1])


# ---------------------------------------------------------------------------------------------
# LAMB (cybertronai/pytorch-lamb style; the optimizer used for Perceiver IO language pre-training)
# ---------------------------------------------------------------------------------------------
class Lamb(Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, adam=False):
        if not 0.0 <= lr:
            raise ValueError("Invalid learning rate: {}".format(lr))
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.adam = adam
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")

                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                beta1, beta2 = group["betas"]
                state["step"] += 1

                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

                bias_correction1 = 1 - beta1 ** state["step"]
                bias_correction2 = 1 - beta2 ** state["step"]
                step_size = group["lr"]

                weight_norm = p.norm(p=2).clamp(0, 10)

                adam_step = (exp_avg / bias_correction1) / (exp_avg_sq / bias_correction2).sqrt().add(group["eps"])
                if group["weight_decay"] != 0:
                    adam_step.add_(p, alpha=group["weight_decay"])

                adam_norm = adam_step.norm(p=2)
                trust_ratio = torch.where(
                    (weight_norm > 0) & (adam_norm > 0), weight_norm / adam_norm, torch.ones_like(weight_norm))
                if self.adam:
                    trust_ratio = torch.ones_like(trust_ratio)
                state["trust_ratio"] = trust_ratio

                p.add_(adam_step * trust_ratio, alpha=-step_size)

        return loss


def param_groups(model, weight_decay):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or "norm" in name or "embedding" in name or name.endswith("latent") or "output_query" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def cosine_with_warmup(warmup_steps, max_steps, min_fraction=0.1):
    def lr_lambda(step):
        if step < warmup_steps:
            return float(step + 1) / float(max(1, warmup_steps))
        progress = float(step - warmup_steps) / float(max(1, max_steps - warmup_steps))
        return max(min_fraction, 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))
    return lr_lambda


# ---------------------------------------------------------------------------------------------
# synthetic byte data + BERT-style masking, done on the GPU
# ---------------------------------------------------------------------------------------------
def random_text_batch(batch_size, max_seq_len, device, generator=None):
    # mostly-ASCII "text": lower-case letters and spaces, shifted into the byte id range
    lengths = torch.randint(max_seq_len // 4, max_seq_len + 1, (batch_size,), device=device, generator=generator)
    lengths[0] = max_seq_len  # a full-length sample in every batch, as a bucketed loader would give
    raw = torch.randint(97, 123, (batch_size, max_seq_len), device=device, generator=generator)
    spaces = torch.rand(batch_size, max_seq_len, device=device, generator=generator) < 0.17
    raw = torch.where(spaces, torch.full_like(raw, 32), raw) + NUM_SPECIAL
    positions = torch.arange(max_seq_len, device=device)
    pad_mask = positions.unsqueeze(0) >= lengths.unsqueeze(1)  # True = padding, ignored by attention
    input_ids = raw.masked_fill(pad_mask, PAD_ID)
    return input_ids, pad_mask


def mask_tokens(input_ids, pad_mask, mask_prob):
    labels = input_ids.clone()
    probability = torch.full(labels.shape, mask_prob, device=input_ids.device)
    probability.masked_fill_(pad_mask, 0.0)
    masked = torch.bernoulli(probability).bool()
    labels[~masked] = -100

    replaced = torch.bernoulli(torch.full(labels.shape, 0.8, device=input_ids.device)).bool() & masked
    inputs = input_ids.clone()
    inputs[replaced] = MASK_ID
    randomized = torch.bernoulli(torch.full(labels.shape, 0.5, device=input_ids.device)).bool() & masked & ~replaced
    random_bytes = torch.randint(NUM_SPECIAL, VOCAB_SIZE, labels.shape, device=input_ids.device)
    inputs[randomized] = random_bytes[randomized]
    return inputs, labels


def main():
    args = get_args()
    torch.manual_seed(args.seed)
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    encoder = PerceiverEncoder(
        InputAdapter(VOCAB_SIZE, args.max_seq_len, args.num_input_channels),
        num_latents=args.num_latents,
        num_latent_channels=args.num_latent_channels,
        num_input_channels=args.num_input_channels,
        num_cross_attention_heads=args.num_cross_attention_heads,
        num_self_attention_heads=args.num_self_attention_heads,
        num_self_attention_layers=args.num_self_attention_layers,
        widening_factor=args.widening_factor,
        dropout=args.dropout,
    )
    decoder = PerceiverDecoder(
        args.max_seq_len, args.num_input_channels, args.num_latent_channels, VOCAB_SIZE,
        args.num_cross_attention_heads, args.widening_factor, args.dropout,
    )
    model = PerceiverIO(encoder, decoder).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Perceiver IO: {n_params / 1e6:.1f}M parameters")

    groups = param_groups(model, args.weight_decay)
    if args.optimizer == "lamb":
        optimizer = Lamb(groups, lr=args.lr, betas=(0.9, 0.999), eps=1e-6)
    else:
        optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(args.warmup_steps, args.max_steps))
    scaler = torch.amp.GradScaler("cuda")

    model.train()
    t0 = time.time()
    running_loss = 0.0
    for step in range(1, args.steps + 1):
        input_ids, pad_mask = random_text_batch(args.batch_size, args.max_seq_len, device)
        inputs, labels = mask_tokens(input_ids, pad_mask, args.mask_prob)

        with torch.autocast(device_type="cuda", dtype=torch.float16):
            logits = model(inputs, pad_mask=pad_mask)
            loss = F.cross_entropy(logits.view(-1, VOCAB_SIZE), labels.view(-1), ignore_index=-100)

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()

        running_loss += loss.item()
        if step % args.log_every == 0 or step == args.steps:
            torch.cuda.synchronize()
            dt = time.time() - t0
            n = args.log_every if step % args.log_every == 0 else step % args.log_every
            print(f"step {step:6d} | loss {running_loss / n:.4f} | grad_norm {grad_norm.item():.3f} | "
                  f"lr {scheduler.get_last_lr()[0]:.3e} | scale {scaler.get_scale():.0f} | "
                  f"{args.batch_size * args.max_seq_len * n / dt:.0f} bytes/s")
            running_loss = 0.0
            t0 = time.time()

    print(f"peak memory allocated: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
          f"reserved: {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
