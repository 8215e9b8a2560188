#!/usr/bin/env python
"""Causal LM fine-tune with Accelerate and hand-written gradient accumulation.

In the manner of transformers' examples/pytorch/language-modeling/run_clm_no_trainer.py,
from before it used ``accelerator.accumulate``: the Accelerator is made without
``gradient_accumulation_steps``; the loss is divided by the number of micro-batches,
``accelerator.backward`` runs on every micro-batch, and the prepared optimizer and
scheduler step every ``--gradient-accumulation-steps`` of them, after
``accelerator.clip_grad_norm_``. Every ``--eval-steps`` optimizer steps the model is
evaluated (perplexity, losses gathered with ``gather_for_metrics``); the state is
saved with ``accelerator.save_state`` at the end. A small GPT-2 is built from a
config (no pretrained weights) and trained on random token ids, so it runs offline.

    python hf_accelerate_manual_accum.py                     # 8 x 512 micro-batches, 4 per step, 3 steps
    accelerate launch hf_accelerate_manual_accum.py --steps 100
"""

import argparse
import math
import os
import tempfile

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator, get_scheduler

logger = get_logger(__name__)


class RandomBlocks(Dataset):
    """Token blocks of ``block_size``, as run_clm's ``group_texts`` leaves them."""

    def __init__(self, n, block_size, vocab_size, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab_size, (n, block_size), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def parse_args():
    p = argparse.ArgumentParser(description="Fine-tune a causal LM with Accelerate, manual accumulation")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (max_train_steps)")
    p.add_argument("--per-device-train-batch-size", type=int, default=8)
    p.add_argument("--per-device-eval-batch-size", type=int, default=8)
    p.add_argument("--gradient-accumulation-steps", type=int, default=4)
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--num-warmup-steps", type=int, default=1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--eval-steps", type=int, default=2, help="evaluate every N optimizer steps")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--output-dir", default=None)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def evaluate(model, eval_dataloader, accelerator, batch_size):
    model.eval()
    losses = []
    for batch in eval_dataloader:
        with torch.no_grad():
            outputs = model(**batch)
        loss = outputs.loss
        losses.append(accelerator.gather_for_metrics(loss.repeat(batch_size)))
    losses = torch.cat(losses)
    try:
        eval_loss = torch.mean(losses)
        perplexity = math.exp(eval_loss)
    except OverflowError:
        perplexity = float("inf")
    model.train()
    return eval_loss.item(), perplexity


def main():
    args = parse_args()
    accelerator = Accelerator(mixed_precision="bf16")
    set_seed(args.seed)

    config = GPT2Config(n_layer=6, n_embd=512, n_head=8, n_positions=args.block_size,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    model = GPT2LMHeadModel(config)

    n_train = args.steps * args.gradient_accumulation_steps * args.per_device_train_batch_size
    train_dataset = RandomBlocks(n_train, args.block_size, config.vocab_size, seed=0)
    eval_dataset = RandomBlocks(args.eval_batches * args.per_device_eval_batch_size, args.block_size,
                                config.vocab_size, seed=1)
    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=default_data_collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator,
                                 batch_size=args.per_device_eval_batch_size)

    no_decay = ["bias", "ln_1.weight", "ln_2.weight", "ln_f.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    num_train_epochs = math.ceil(args.steps / num_update_steps_per_epoch)
    lr_scheduler = get_scheduler(
        name="cosine",
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.steps * accelerator.num_processes,
    )

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    total_batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {total_batch_size}")
    accelerator.print(f"params: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M, "
                      f"{args.steps} steps of {total_batch_size} sequences")

    completed_steps = 0
    for epoch in range(num_train_epochs):
        model.train()
        total_loss = 0.0
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            loss = outputs.loss
            loss = loss / args.gradient_accumulation_steps
            accelerator.backward(loss)
            total_loss += accelerator.gather_for_metrics(loss.detach()).float().sum().item()

            if (step + 1) % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                completed_steps += 1
                accelerator.print(f"step {completed_steps}: loss {total_loss:.4f} grad_norm {grad_norm.item():.3f} "
                                  f"lr {lr_scheduler.get_last_lr()[0]:.2e}")
                total_loss = 0.0

                if completed_steps % args.eval_steps == 0:
                    eval_loss, perplexity = evaluate(model, eval_dataloader, accelerator,
                                                     args.per_device_eval_batch_size)
                    accelerator.print(f"step {completed_steps}: eval_loss {eval_loss:.4f} perplexity {perplexity:.2f}")

            if completed_steps >= args.steps:
                break

    accelerator.wait_for_everyone()
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="clm_state_")
    accelerator.save_state(os.path.join(output_dir, f"step_{completed_steps}"))
    accelerator.print(f"saved state to {output_dir}")
    if torch.cuda.is_available():
        accelerator.print(f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
