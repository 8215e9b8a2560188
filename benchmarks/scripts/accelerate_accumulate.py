#!/usr/bin/env python
"""Sequence-to-sequence training with Accelerate's gradient accumulation.

In the manner of transformers' examples/pytorch/summarization/run_summarization_no_trainer.py
and Accelerate's documented accumulation loop (docs: "Performing gradient
accumulation with Accelerate"): ``Accelerator(mixed_precision="bf16",
gradient_accumulation_steps=4)``, everything through ``accelerator.prepare``,
and the step inside ``with accelerator.accumulate(model):``, where the
prepared optimizer and scheduler step only when ``accelerator.sync_gradients``.
A BART-base sized ``BartForConditionalGeneration`` is built from a config (no
pretrained weights) and trained on random token ids, so it runs offline.

    python accelerate_accumulate.py                              # BART-base, 8 x (512 -> 128), 4 micro-batches a step
    python accelerate_accumulate.py --tiny --cpu                 # a quick check on the CPU
"""

import argparse
import math

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import BartConfig, BartForConditionalGeneration, get_linear_schedule_with_warmup


class RandomPairs(Dataset):
    """Source / target token ids of fixed lengths, padded as the summarization example pads
    (``pad_to_max_length``), label padding as -100."""

    def __init__(self, n, source_len, target_len, vocab_size, pad_id=1, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.src = torch.randint(4, vocab_size, (n, source_len), generator=g)
        self.tgt = torch.randint(4, vocab_size, (n, target_len), generator=g)
        # ragged lengths, as real documents have: pad the tail of each sample
        self.src_len = torch.randint(source_len // 2, source_len + 1, (n,), generator=g)
        self.tgt_len = torch.randint(target_len // 2, target_len + 1, (n,), generator=g)
        self.pad_id = pad_id

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        src, tgt = self.src[i].clone(), self.tgt[i].clone()
        src[self.src_len[i]:] = self.pad_id
        mask = (src != self.pad_id).long()
        labels = tgt.clone()
        labels[self.tgt_len[i]:] = -100
        return {"input_ids": src, "attention_mask": mask, "labels": labels}


def parse_args():
    p = argparse.ArgumentParser(description="Train BART with Accelerate's gradient accumulation on random tokens")
    p.add_argument("--vocab-size", type=int, default=50265)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=6, help="encoder and decoder layers each")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--ffn-dim", type=int, default=3072)
    p.add_argument("--max-source-length", type=int, default=512)
    p.add_argument("--max-target-length", type=int, default=128)
    p.add_argument("--per-device-train-batch-size", type=int, default=8)
    p.add_argument("--gradient-accumulation-steps", type=int, default=4)
    p.add_argument("--max-train-steps", type=int, default=6)
    p.add_argument("--num-warmup-steps", type=int, default=1)
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--mixed-precision", default="bf16", choices=["no", "fp16", "bf16"])
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a small model for a CPU check")
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args()
    if args.tiny:
        args.vocab_size, args.d_model, args.layers, args.heads, args.ffn_dim = 1000, 64, 2, 4, 128
        args.max_source_length, args.max_target_length, args.per_device_train_batch_size = 64, 16, 2
        args.max_train_steps = 2
    return args


def main():
    args = parse_args()
    accelerator = Accelerator(mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps, cpu=args.cpu)
    set_seed(args.seed)

    config = BartConfig(
        vocab_size=args.vocab_size, d_model=args.d_model,
        encoder_layers=args.layers, decoder_layers=args.layers,
        encoder_attention_heads=args.heads, decoder_attention_heads=args.heads,
        encoder_ffn_dim=args.ffn_dim, decoder_ffn_dim=args.ffn_dim,
        max_position_embeddings=max(1024, args.max_source_length),
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
    )
    model = BartForConditionalGeneration(config)

    no_decay = ["bias", "layer_norm.weight", "layernorm_embedding.weight"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.learning_rate)

    micro_batches = args.max_train_steps * args.gradient_accumulation_steps
    dataset = RandomPairs(micro_batches * args.per_device_train_batch_size, args.max_source_length,
                          args.max_target_length, args.vocab_size, pad_id=config.pad_token_id)
    train_dataloader = DataLoader(dataset, shuffle=True, batch_size=args.per_device_train_batch_size)

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps * accelerator.num_processes)

    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)

    n_params = sum(p.numel() for p in model.parameters())
    accelerator.print(f"{n_params / 1e6:.1f} M parameters, {num_update_steps_per_epoch} optimizer steps of "
                      f"{args.gradient_accumulation_steps} micro-batches")
    model.train()
    completed_steps = 0
    total_loss = 0.0
    for step, batch in enumerate(train_dataloader):
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            total_loss += loss.detach().float()
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            completed_steps += 1
            accelerator.print(f"step {completed_steps}: loss {total_loss.item() / args.gradient_accumulation_steps:.4f} "
                              f"lr {lr_scheduler.get_last_lr()[0]:.2e}")
            total_loss = 0.0
        if completed_steps >= args.max_train_steps:
            break


if __name__ == "__main__":
    main()
