# Full fine-tune of a ~300M Llama-style decoder with the optimizer fused into backward,
# torchtune habits (recipes/full_finetune_single_device.py with optimizer_in_bwd=True,
# training/memory.py's OptimizerInBackwardWrapper / register_optim_in_bwd_hooks):
# pure bf16 params (model.to(torch.bfloat16)), one AdamW per parameter stepped in a
# post-accumulate-grad hook, an LR scheduler per optimizer, the loop only calls
# loss.backward(); every decoder layer wrapped in non-reentrant activation checkpointing.
import argparse
import math
import time
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x_fp32 = x.float()
        x_normed = (x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return x_normed * self.scale


class RotaryPositionalEmbeddings(nn.Module):
    def __init__(self, dim, max_seq_len=4096, base=10_000):
        super().__init__()
        self.dim = dim
        theta = 1.0 / (base ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
        seq_idx = torch.arange(max_seq_len, dtype=theta.dtype)
        idx_theta = torch.einsum("i,j->ij", seq_idx, theta).float()
        cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
        self.register_buffer("cache", cache, persistent=False)

    def forward(self, x):
        # x: [b, s, n_h, h_d]
        seq_len = x.size(1)
        rope_cache = self.cache[:seq_len]
        xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
        rope_cache = rope_cache.view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
        x_out = torch.stack(
            [
                xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
                xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
            ],
            -1,
        )
        return x_out.flatten(3).type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, num_heads, num_kv_heads, rope):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = dim // num_heads
        self.q_proj = nn.Linear(dim, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.output_proj = nn.Linear(num_heads * self.head_dim, dim, bias=False)
        self.pos_embeddings = rope

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        q = self.pos_embeddings(q)
        k = self.pos_embeddings(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.num_kv_heads != self.num_heads:
            rep = self.num_heads // self.num_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).contiguous().view(b, s, -1)
        return self.output_proj(out)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerDecoderLayer(nn.Module):
    def __init__(self, dim, num_heads, num_kv_heads, hidden_dim, rope):
        super().__init__()
        self.sa_norm = RMSNorm(dim)
        self.attn = CausalSelfAttention(dim, num_heads, num_kv_heads, rope)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = FeedForward(dim, hidden_dim)

    def forward(self, x):
        h = x + self.attn(self.sa_norm(x))
        return h + self.mlp(self.mlp_norm(h))


class TransformerDecoder(nn.Module):
    def __init__(self, vocab_size, num_layers, dim, num_heads, num_kv_heads, hidden_dim,
                 max_seq_len, activation_checkpointing=True):
        super().__init__()
        rope = RotaryPositionalEmbeddings(dim // num_heads, max_seq_len=max_seq_len)
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(
            TransformerDecoderLayer(dim, num_heads, num_kv_heads, hidden_dim, rope)
            for _ in range(num_layers)
        )
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.activation_checkpointing = activation_checkpointing

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            if self.activation_checkpointing and self.training:
                h = checkpoint(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        h = self.norm(h)
        return self.output(h).float()


class OptimizerInBackwardWrapper:
    """torchtune.training.OptimizerInBackwardWrapper, trimmed: one optimizer per parameter."""

    def __init__(self, optim_map):
        self.optim_map = optim_map
        self.lr_schedulers = None

    def state_dict(self):
        return {p: opt.state_dict() for p, opt in self.optim_map.items()}

    def set_lr_schedulers(self, make_scheduler):
        self.lr_schedulers = {p: make_scheduler(opt) for p, opt in self.optim_map.items()}

    def step_lr_schedulers(self):
        for sched in self.lr_schedulers.values():
            sched.step()

    def get_optim_key(self, key):
        return self.optim_map[next(iter(self.optim_map))].param_groups[0][key]


def register_optim_in_bwd_hooks(model, optim_dict):
    def optim_step(param) -> None:
        optim_dict[param].step()
        optim_dict[param].zero_grad()

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(optim_step)


def cosine_with_warmup(step, num_warmup_steps, num_training_steps, num_cycles=0.5):
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress)))


def main():
    parser = argparse.ArgumentParser(description="optimizer-in-backward full finetune")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--num-layers", type=int, default=18)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=16)
    parser.add_argument("--hidden-dim", type=int, default=2816)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--no-activation-checkpointing", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device("cuda")

    model = TransformerDecoder(
        args.vocab_size, args.num_layers, args.dim, args.num_heads, args.num_kv_heads,
        args.hidden_dim, args.seq_len, activation_checkpointing=not args.no_activation_checkpointing,
    )
    model = model.to(device=device, dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model has {n_params / 1e6:.1f}M params, dtype {next(model.parameters()).dtype}")

    # torchtune: optim_dict = {p: config.instantiate(cfg_optimizer, [p]) for p in model.parameters()}
    optim_dict = {
        p: torch.optim.AdamW([p], lr=args.lr, weight_decay=args.weight_decay)
        for p in model.parameters()
    }
    register_optim_in_bwd_hooks(model, optim_dict)
    optim_ckpt_wrapper = OptimizerInBackwardWrapper(optim_dict)
    optim_ckpt_wrapper.set_lr_schedulers(
        lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, partial(cosine_with_warmup, num_warmup_steps=args.warmup_steps,
                         num_training_steps=args.max_steps)
        )
    )
    loss_fn = nn.CrossEntropyLoss(ignore_index=-100)

    model.train()
    torch.cuda.reset_peak_memory_stats()
    for step in range(args.max_steps):
        t0 = time.perf_counter()
        tokens = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), device=device)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        logits = model(inputs)
        logits = logits.reshape(-1, logits.size(-1))
        labels = labels.reshape(-1)
        loss = loss_fn(logits, labels)
        del logits
        # the optimizers step and zero their grads inside backward's hooks
        loss.backward()
        optim_ckpt_wrapper.step_lr_schedulers()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(
            f"step {step}: loss {loss.item():.4f} lr {optim_ckpt_wrapper.get_optim_key('lr'):.2e} "
            f"{args.batch_size * args.seq_len / dt:,.0f} tok/s "
            f"peak_alloc {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB "
            f"peak_reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB"
        )


if __name__ == "__main__":
    main()
