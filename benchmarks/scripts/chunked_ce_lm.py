"""
Pretrain a small Llama-style decoder with a chunked, fused linear + cross-entropy loss.

The loss is Liger-Kernel's FusedLinearCrossEntropy idea in plain PyTorch: the (tokens x vocab)
logits are never materialised for the whole batch. The forward of a custom autograd.Function
walks the flattened hidden states in chunks; for each chunk it computes the logits, the loss
and right away the gradient of the loss w.r.t. the chunk's hidden states and the lm_head weight
(accumulated into a preallocated fp32 buffer). Only those two gradients are saved for backward,
which just scales them by grad_output. The decoder layers are checkpointed the way
transformers' `gradient_checkpointing_enable()` does it (non-reentrant torch.utils.checkpoint
per layer).

    python chunked_ce_lm.py --hidden-size 2048 --layers 16 --heads 16 --vocab-size 128256 \
        --seq-len 4096 --batch-size 4
"""
import argparse
import functools
import math
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--intermediate-size", type=int, default=1376)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--no-fused-ce", action="store_true", help="plain lm_head + F.cross_entropy, for comparison")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args()


# ----------------------------------------------------------------------------------------------
# Fused linear cross-entropy (after linkedin/Liger-Kernel, ops/fused_linear_cross_entropy.py)
# ----------------------------------------------------------------------------------------------
def _next_power_of_2(n):
    return 1 << (n - 1).bit_length()


def fused_linear_cross_entropy_forward(_input, weight, target, bias=None, ignore_index=-100):
    device = _input.device
    BT, H = _input.shape
    V = weight.shape[0]

    # Same chunking heuristic as Liger: keep a chunk's logits about the size of the hidden states.
    inc_factor = math.ceil(V / H)
    chunk_size = _next_power_of_2(math.ceil(BT / inc_factor))
    num_chunks = math.ceil(BT / chunk_size)

    grad_weight = torch.zeros_like(weight, device=device) if weight.requires_grad else None
    grad_input = torch.zeros_like(_input, device=device)
    grad_bias = torch.zeros_like(bias, device=device) if bias is not None else None
    loss_1d = torch.zeros(BT, dtype=torch.float32, device=device)

    target_mask = target != ignore_index
    total_n_non_ignore = target_mask.sum().item()

    for chunk_id in range(num_chunks):
        start_idx = chunk_id * chunk_size
        end_idx = min((chunk_id + 1) * chunk_size, BT)
        _input_chunk = _input[start_idx:end_idx]  # chunk_size x H

        logits_chunk = _input_chunk @ weight.t()  # chunk_size x V
        if bias is not None:
            logits_chunk = logits_chunk + bias
        target_chunk = target[start_idx:end_idx]
        valid = target_mask[start_idx:end_idx]

        # cross entropy and its gradient w.r.t. the logits, in fp32 like the Triton kernel
        logits_f32 = logits_chunk.float()
        lse = torch.logsumexp(logits_f32, dim=-1)
        safe_target = target_chunk.masked_fill(~valid, 0)
        target_logit = logits_f32.gather(1, safe_target.unsqueeze(1)).squeeze(1)
        loss_1d[start_idx:end_idx] = (lse - target_logit) * valid / total_n_non_ignore

        grad_logits = torch.softmax(logits_f32, dim=-1)
        grad_logits.scatter_add_(1, safe_target.unsqueeze(1),
                                 torch.full_like(target_logit, -1.0).unsqueeze(1))
        grad_logits.mul_((valid / total_n_non_ignore).unsqueeze(1))
        grad_logits_chunk = grad_logits.to(_input_chunk.dtype)  # written back in the input's dtype
        del logits_f32, grad_logits

        grad_input[start_idx:end_idx] = grad_logits_chunk @ weight
        if grad_weight is not None:
            grad_weight += torch.mm(grad_logits_chunk.t(), _input_chunk).float()
        if bias is not None:
            grad_bias += grad_logits_chunk.sum(dim=0).float()

    loss = torch.sum(loss_1d)
    return loss, grad_input, grad_weight, grad_bias


def fused_linear_cross_entropy_backward(grad_output, grad_input, grad_weight, grad_bias):
    # If cross entropy is the last layer, grad_output is 1.0: skip the multiplications.
    if not torch.equal(grad_output, torch.tensor(1.0, device=grad_output.device)):
        grad_input = grad_input * grad_output
        if grad_weight is not None:
            grad_weight = grad_weight * grad_output
        if grad_bias is not None:
            grad_bias = grad_bias * grad_output
    return grad_input, grad_weight, grad_bias


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, _input, weight, target, bias=None, ignore_index=-100):
        loss, grad_input, grad_weight, grad_bias = fused_linear_cross_entropy_forward(
            _input, weight, target, bias, ignore_index)
        # downcast to dtype and store for backward
        ctx.save_for_backward(
            grad_input.detach(),
            grad_weight.detach() if grad_weight is not None else None,
            grad_bias.detach() if grad_bias is not None else None,
        )
        return loss

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_output):
        (grad_input, grad_weight, grad_bias) = ctx.saved_tensors
        grad_input, grad_weight, grad_bias = fused_linear_cross_entropy_backward(
            grad_output, grad_input, grad_weight, grad_bias)
        return grad_input, grad_weight, None, grad_bias, None


class FusedLinearCrossEntropyLoss(nn.Module):
    def __init__(self, ignore_index=-100):
        super().__init__()
        self.ignore_index = ignore_index

    def forward(self, lin_weight, _input, target, bias=None):
        return FusedLinearCrossEntropyFunction.apply(_input, lin_weight, target, bias, self.ignore_index)


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def precompute_rope(head_dim, seq_len, theta=10000.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(seq_len).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:T].to(q.dtype), sin[:T].to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, hidden, intermediate):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, hidden, intermediate, heads):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.self_attn = Attention(hidden, heads)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.mlp = MLP(hidden, intermediate)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderLM(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            [DecoderLayer(args.hidden_size, args.intermediate_size, args.heads) for _ in range(args.layers)])
        self.norm = RMSNorm(args.hidden_size)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        cos, sin = precompute_rope(args.hidden_size // args.heads, args.seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.use_fused_ce = not args.no_fused_ce
        self.loss_fn = FusedLinearCrossEntropyLoss()
        self.gradient_checkpointing = False
        self._gradient_checkpointing_func = None
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        kwargs = gradient_checkpointing_kwargs or {"use_reentrant": False}
        self._gradient_checkpointing_func = functools.partial(checkpoint, **kwargs)
        self.gradient_checkpointing = True

    def forward(self, input_ids, labels=None):
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                hidden_states = self._gradient_checkpointing_func(
                    layer.__call__, hidden_states, self.rope_cos, self.rope_sin)
            else:
                hidden_states = layer(hidden_states, self.rope_cos, self.rope_sin)
        hidden_states = self.norm(hidden_states)

        if labels is not None and self.training and self.use_fused_ce:
            # Liger's patched *ForCausalLM.forward: no logits at all in training.
            shift_hidden = hidden_states[..., :-1, :].contiguous().view(-1, hidden_states.size(-1))
            shift_labels = labels[..., 1:].contiguous().view(-1)
            loss = self.loss_fn(self.lm_head.weight, shift_hidden, shift_labels)
            return None, loss

        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            logits = logits.float()
            loss = F.cross_entropy(logits[..., :-1, :].reshape(-1, logits.size(-1)), labels[..., 1:].reshape(-1))
        return logits, loss


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    device_type = "cuda" if "cuda" in device else "cpu"
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    ptdtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    ctx = nullcontext() if device_type == "cpu" or ptdtype is torch.float32 else torch.autocast(
        device_type=device_type, dtype=ptdtype)

    model = DecoderLM(args).to(device)
    if not args.no_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    print(f"number of parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    use_fused = device_type == "cuda"
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=use_fused)
    print(f"using fused AdamW: {use_fused}")

    for step in range(args.steps):
        t0 = time.time()
        input_ids = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len), device=device)
        labels = input_ids.clone()
        labels[:, :8] = -100  # e.g. a prompt that is not trained on
        with ctx:
            _, loss = model(input_ids, labels=labels)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device_type == "cuda":
            torch.cuda.synchronize()
        dt = time.time() - t0
        tok_s = args.batch_size * args.seq_len / dt
        print(f"step {step:3d} | loss {loss.item():.4f} | norm {norm.item():.2f} | {dt * 1000:.0f} ms | {tok_s:.0f} tok/s")

    if device_type == "cuda":
        print(f"peak memory allocated: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
