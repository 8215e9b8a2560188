#!/usr/bin/env python
"""LoRA fine-tuning of a Llama-style causal LM with PEFT, in a plain PyTorch loop.

The base model is built from a config (random weights) and the data are random tokens,
so nothing is downloaded.

    python peft_lora.py                                   # ~270M-param base in bf16, batch 8 x 1024
    python peft_lora.py --device cpu --hidden-size 64 --intermediate-size 176 \
        --num-layers 2 --num-heads 4 --vocab-size 1000 --seq-len 32 --batch-size 2
"""

import argparse
import time

import torch
from torch.utils.data import DataLoader, Dataset

from peft import LoraConfig, TaskType, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, get_linear_schedule_with_warmup, set_seed


class RandomTokens(Dataset):
    def __init__(self, num_samples, seq_len, vocab_size, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, vocab_size, (num_samples, seq_len), generator=g)

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, idx):
        input_ids = self.input_ids[idx]
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids.clone()}


def parse_args():
    parser = argparse.ArgumentParser(description="LoRA fine-tuning with PEFT")
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--intermediate-size", type=int, default=2816)
    parser.add_argument("--num-layers", type=int, default=16)
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=None, help="defaults to --num-heads")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--lora-alpha", type=int, default=32)
    parser.add_argument("--lora-dropout", type=float, default=0.05)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def main():
    args = parse_args()
    set_seed(args.seed)
    device = torch.device(args.device)
    # bf16 weights and autocast on the GPU; plain fp32 on the CPU
    use_bf16 = device.type == "cuda"
    dtype = torch.bfloat16 if use_bf16 else torch.float32

    config = LlamaConfig(
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads or args.num_heads,
        vocab_size=args.vocab_size,
        max_position_embeddings=max(2048, args.seq_len),
        use_cache=False,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to(device)

    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()

    peft_config = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    )
    model = get_peft_model(model, peft_config)
    model.print_trainable_parameters()

    train_dataset = RandomTokens(args.batch_size * args.steps, args.seq_len, args.vocab_size, seed=args.seed)
    train_dataloader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=True, pin_memory=use_bf16)

    optimizer = torch.optim.AdamW(filter(lambda p: p.requires_grad, model.parameters()), lr=args.lr)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=args.steps
    )

    model.train()
    for step, batch in enumerate(train_dataloader):
        t0 = time.perf_counter()
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_bf16):
            outputs = model(**batch)
        loss = outputs.loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        loss_val = loss.item()
        dt = time.perf_counter() - t0
        tokens_per_s = batch["input_ids"].numel() / dt
        print(f"step {step + 1}/{args.steps} | loss {loss_val:.4f} | lr {lr_scheduler.get_last_lr()[0]:.2e} "
              f"| {dt * 1000:.0f} ms | {tokens_per_s:,.0f} tok/s")

    if device.type == "cuda":
        print(f"peak memory allocated: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
