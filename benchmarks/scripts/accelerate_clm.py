#!/usr/bin/env python
"""Causal language modelling with Hugging Face Accelerate, no Trainer.

In the manner of transformers' examples/pytorch/language-modeling/run_clm_no_trainer.py:
the model and optimizer are made on the CPU and handed to ``accelerator.prepare``,
which moves the model and wraps both; mixed precision and gradient accumulation
are the Accelerator's. A Llama-style decoder is built from a config (no
pretrained weights) and trained on random token ids, so it runs offline.

    python accelerate_clm.py                                    # bf16, 2 micro-batches of 8 x 1024
    accelerate launch accelerate_clm.py --mixed-precision no
"""

import argparse
import math

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import AutoConfig, AutoModelForCausalLM, get_scheduler


class RandomBlocks(Dataset):
    """Token blocks of a fixed length, as run_clm's group_texts makes them."""

    def __init__(self, num_samples, block_size, vocab_size, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab_size, (num_samples, block_size), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def parse_args():
    p = argparse.ArgumentParser(description="Train a causal LM with Accelerate on random tokens")
    p.add_argument("--model-type", default="llama")
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--intermediate-size", type=int, default=2816)
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--per-device-train-batch-size", type=int, default=8)
    p.add_argument("--gradient-accumulation-steps", type=int, default=2)
    p.add_argument("--mixed-precision", default="bf16", choices=["no", "fp16", "bf16"])
    p.add_argument("--learning-rate", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-train-steps", type=int, default=8)
    p.add_argument("--num-warmup-steps", type=int, default=2)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)

    config = AutoConfig.for_model(
        args.model_type, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads, vocab_size=args.vocab_size,
        max_position_embeddings=args.block_size,
    )
    model = AutoModelForCausalLM.from_config(config)

    # weight decay on matrices only, as run_clm_no_trainer does
    no_decay = ["bias", "norm.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate)

    samples = args.max_train_steps * args.gradient_accumulation_steps * args.per_device_train_batch_size
    train_dataloader = DataLoader(RandomBlocks(samples, args.block_size, args.vocab_size), shuffle=True,
                                  batch_size=args.per_device_train_batch_size, num_workers=args.num_workers,
                                  pin_memory=True)
    lr_scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=args.max_train_steps)

    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)

    steps = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    accelerator.print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, {steps} optimizer steps")
    model.train()
    completed = 0
    for step, batch in enumerate(train_dataloader):
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            completed += 1
            accelerator.print(f"step {completed}: loss {loss.item():.4f}")
        if completed >= args.max_train_steps:
            break


if __name__ == "__main__":
    main()
