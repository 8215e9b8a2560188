#!/usr/bin/env python
"""Pre-train a Llama-style decoder with FSDP2 (``fully_shard``), written for torchrun.

In the manner of torchtitan: every decoder layer and then the root are sharded
with ``fully_shard`` under a bf16 mixed-precision policy (fp32 reductions),
activation checkpointing wraps each layer (``checkpoint_wrapper``) when asked,
the gradient norm is clipped across the shards, and random token ids stand in
for a dataset, so it runs offline.

    torchrun --nproc_per_node=8 fsdp2_llama.py --activation-checkpointing
    python fsdp2_llama.py                                   # one process (world size 1)
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM


def parse_args():
    p = argparse.ArgumentParser(description="FSDP2 pre-training on random tokens")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--ffn-dim", type=int, default=5632)
    p.add_argument("--n-layers", type=int, default=16)
    p.add_argument("--n-heads", type=int, default=16)
    p.add_argument("--n-kv-heads", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--local-batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--activation-checkpointing", action="store_true")
    return p.parse_args()


def main():
    args = parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29522")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("nccl")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    torch.manual_seed(0)

    config = LlamaConfig(hidden_size=args.dim, intermediate_size=args.ffn_dim, num_hidden_layers=args.n_layers,
                         num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
                         vocab_size=args.vocab_size, max_position_embeddings=args.seq_len, use_cache=False)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        if args.activation_checkpointing:
            layer = checkpoint_wrapper(layer)
            layers[i] = layer
        # the last layer's parameters are needed right away in backward: keep them gathered
        fully_shard(layer, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mp_policy=mp)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 2))
    rank = dist.get_rank()
    for step in range(args.steps):
        ids = torch.randint(0, args.vocab_size, (args.local_batch_size, args.seq_len), device="cuda")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f} grad norm {norm.full_tensor().item():.3f} "
                  f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
