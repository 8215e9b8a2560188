#!/usr/bin/env python
"""Single-GPU Llama pre-training with meta-device init and op-level selective AC.

In the manner of torchtitan (``torchtitan/models/llama3``, ``_apply_ac_to_transformer_block``
with ``selective_ac_option="op"``) and gpt-fast: the model is built under
``with torch.device("meta")``, cast to bf16 while still on meta, materialised with
``model.to_empty(device="cuda")`` and filled by the modules' own ``init_weights()``
(depth-scaled truncated normals, the RoPE table ``freqs_cis`` a non-persistent complex
buffer recomputed there). Each block runs under non-reentrant ``checkpoint`` with
``create_selective_checkpoint_contexts``: matmuls (every other ``aten.mm``) and SDPA
outputs are saved, everything else recomputed. Fused AdamW (foreach where fused is not
available), ``clip_grad_norm_(foreach=True)``, linear-warmup ``LambdaLR``; random tokens.

    python titan_meta_init.py                         # pure bf16 params, op-level SAC
    python titan_meta_init.py --precision amp --ac full
"""

import argparse
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


@dataclass
class ModelArgs:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 8192
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 512
    depth_init: bool = True


def precompute_freqs_cis(dim: int, end: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def reshape_for_broadcast(freqs_cis, x):
    seqlen = x.shape[1]
    freqs_cis = freqs_cis[0:seqlen]
    shape = [d if i == 1 or i == x.ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim)
            .reshape(bs, slen, n_kv_heads * n_rep, head_dim))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def init_weights(self, init_std: float):
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, multiple_of, ffn_dim_multiplier):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        if ffn_dim_multiplier is not None:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float):
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.multiple_of, args.ffn_dim_multiplier)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        if args.depth_init:
            self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5
        else:
            self.weight_init_std = 0.02 / (2 * args.n_layers) ** 0.5

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self):
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.model_args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # persistent=False: not in the state dict, recomputed by init_weights after to_empty
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.layers = nn.ModuleDict()
        for layer_id in range(args.n_layers):
            self.layers[str(layer_id)] = TransformerBlock(layer_id, args)
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.ac_mode = "none"
        self._ac_context_fns = {}

    def _precompute_freqs_cis(self):
        return precompute_freqs_cis(self.model_args.dim // self.model_args.n_heads,
                                    self.model_args.max_seq_len * 2, self.model_args.rope_theta)

    def init_weights(self, buffer_device: torch.device | None = None):
        buffer_device = buffer_device or self.freqs_cis.device
        with torch.device(buffer_device):
            self.freqs_cis = self._precompute_freqs_cis()
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        final_out_std = self.model_args.dim ** -0.5
        cutoff_factor = 3
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=final_out_std,
                              a=-cutoff_factor * final_out_std, b=cutoff_factor * final_out_std)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer_id, layer in self.layers.items():
            if self.ac_mode == "none":
                h = layer(h, self.freqs_cis)
            elif self.ac_mode == "full":
                h = checkpoint(layer, h, self.freqs_cis, use_reentrant=False, preserve_rng_state=False)
            else:
                h = checkpoint(layer, h, self.freqs_cis, use_reentrant=False, preserve_rng_state=False,
                               context_fn=self._ac_context_fns[layer_id])
        h = self.norm(h)
        return self.output(h)


# torchtitan's op-level selective AC: save these ops' outputs, recompute the rest
_save_list = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten.max.default,
}
if hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
    _save_list.add(torch.ops.aten._scaled_dot_product_cudnn_attention.default)


def _get_custom_policy(meta):
    def _custom_policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        mm_count_key = f"{mode}_mm_count"
        if func == torch.ops.aten.mm.default:
            meta[mm_count_key] += 1
        # Saves output of all compute ops, except every second mm
        to_save = func in _save_list and not (func == torch.ops.aten.mm.default and meta[mm_count_key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE
    return _custom_policy


def apply_ac(model: Transformer, mode: str):
    model.ac_mode = mode
    if mode == "op":
        def selective_checkpointing_context_fn():
            meta = defaultdict(int)  # one mm counter per checkpointed call, as torchtitan's
            return create_selective_checkpoint_contexts(_get_custom_policy(meta))

        for layer_id in model.layers:
            model._ac_context_fns[layer_id] = selective_checkpointing_context_fn


def linear_warmup_lambda(current_step: int, warmup_steps: int):
    current_step += 1
    return min(1.0, current_step / max(1, warmup_steps))


def parse_args():
    p = argparse.ArgumentParser(description="torchtitan-style single-GPU Llama on random tokens")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=8e-4)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--ac", choices=["none", "full", "op"], default="op")
    p.add_argument("--precision", choices=["bf16", "amp"], default="bf16",
                   help="bf16: model.to(torch.bfloat16); amp: fp32 params under bf16 autocast")
    return p.parse_args()


def main():
    args = parse_args()
    torch.manual_seed(42)
    device = torch.device("cuda")
    model_args = ModelArgs(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                           vocab_size=args.vocab_size, max_seq_len=args.seq_len)
    with torch.device("meta"):
        model = Transformer(model_args)
    if args.precision == "bf16":
        model.to(torch.bfloat16)  # still on meta: nothing allocated
    apply_ac(model, args.ac)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params: {n_params / 1e6:.1f}M  dtype: {next(model.parameters()).dtype}  "
          f"freqs_cis: {model.freqs_cis.dtype} {tuple(model.freqs_cis.shape)} on {model.freqs_cis.device}")

    fused = "fused" in torch.optim.AdamW.__init__.__code__.co_varnames and torch.cuda.is_available()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  eps=1e-8, fused=fused or None, foreach=None if fused else True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(linear_warmup_lambda,
                                                                     warmup_steps=args.warmup_steps))
    print(f"AdamW {'fused' if fused else 'foreach'}, AC={args.ac}, precision={args.precision}")

    torch.cuda.reset_peak_memory_stats()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        tokens = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), device=device)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.precision == "amp"):
            pred = model(inputs)
            loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
        del pred
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm, foreach=True)
        optimizer.step()
        scheduler.step()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        tps = args.batch_size * args.seq_len / dt
        print(f"step {step:3d} | loss {loss.item():.4f} | grad_norm {grad_norm.item():.3f} | "
              f"lr {scheduler.get_last_lr()[0]:.2e} | tps {tps:,.0f} | "
              f"mem {torch.cuda.memory_allocated() / 2**30:.2f} GiB")
        if not math.isfinite(loss.item()):
            raise SystemExit("loss is not finite")

    print(f"peak memory: {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB "
          f"(max_memory_allocated = {torch.cuda.max_memory_allocated()})")


if __name__ == "__main__":
    main()
