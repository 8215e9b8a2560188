#!/usr/bin/env python
"""Fine-tune a Llama-style decoder with FSDP1 (``FullyShardedDataParallel``), written for torchrun.

In the manner of llama-recipes and Stanford Alpaca's FSDP path (2023-2024): the
model is built from a ``LlamaConfig``, every ``LlamaDecoderLayer`` is its own FSDP
unit (``transformer_auto_wrap_policy``), parameters are gathered in bf16
(``MixedPrecision``), FULL_SHARD, ``limit_all_gathers``, ``use_orig_params``,
activation checkpointing applied with ``apply_activation_checkpointing`` (non-reentrant),
AdamW, ``model.clip_grad_norm_``, a DistributedSampler over a synthetic dataset, and the
loss all-reduced for the log.

    torchrun --nproc_per_node=8 fsdp1_llama.py
    python fsdp1_llama.py                      # one process (world size 1)
"""

import argparse
import functools
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


class SyntheticTokens(Dataset):
    """Random token ids standing in for a tokenised instruction dataset."""

    def __init__(self, n, seq_len, vocab_size, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab_size, (n, seq_len), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def parse_args():
    p = argparse.ArgumentParser(description="FSDP1 fine-tuning on random tokens")
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--intermediate-size", type=int, default=5632)
    p.add_argument("--num-layers", type=int, default=16)
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4, help="per GPU")
    p.add_argument("--num-samples", type=int, default=256)
    p.add_argument("--max-steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--no-activation-checkpointing", action="store_true")
    return p.parse_args()


def setup():
    # llama-recipes' setup(): torchrun sets the env; a plain `python` run is one rank of one
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("nccl")


def main():
    args = parse_args()
    setup()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    torch.cuda.empty_cache()
    torch.manual_seed(42)

    config = LlamaConfig(
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_heads,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.seq_len,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)  # built on the CPU in fp32, as the recipes load it
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"--> model has {n / 1e6:.1f} M parameters")

    llama_auto_wrap_policy = functools.partial(transformer_auto_wrap_policy,
                                               transformer_layer_cls={LlamaDecoderLayer})
    bf16_policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                 buffer_dtype=torch.bfloat16)
    model = FSDP(
        model,
        auto_wrap_policy=llama_auto_wrap_policy,
        mixed_precision=bf16_policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.cuda.current_device(),
        limit_all_gathers=True,
        sync_module_states=False,
        use_orig_params=True,
    )
    if not args.no_activation_checkpointing:
        non_reentrant_wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=non_reentrant_wrapper,
                                       check_fn=lambda m: isinstance(m, LlamaDecoderLayer))

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.85)

    dataset = SyntheticTokens(args.num_samples, args.seq_len, args.vocab_size)
    sampler = DistributedSampler(dataset, rank=rank, num_replicas=world_size, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=1,
                        pin_memory=True, drop_last=True)

    model.train()
    step = 0
    sampler.set_epoch(0)
    for batch in loader:
        t0 = time.perf_counter()
        batch = {k: v.to(local_rank) for k, v in batch.items()}
        loss = model(**batch).loss
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        if rank == 0:
            print(f"step {step}: loss {total.item() / world_size:.4f} "
                  f"{time.perf_counter() - t0:.2f}s peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
        step += 1
        if step >= args.max_steps:
            break

    dist.barrier()
    if rank == 0:
        print(f"max memory reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
