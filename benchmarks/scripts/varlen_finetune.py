#!/usr/bin/env python
"""Fine-tune a Transformer encoder classifier on variable-length text, with dynamic padding.

The usual single-GPU fine-tuning loop in plain PyTorch: a DataLoader whose collate
function pads each batch to its own longest sequence (so every batch has a different
shape), fp16 autocast with a GradScaler, AdamW with no weight decay on biases and
norms, gradient clipping after unscaling, a linear warmup/decay schedule, and
``torch.cuda.empty_cache()`` every few steps. Varying shapes fragment PyTorch's caching
allocator, hence expandable segments, set at the top unless the environment already
says otherwise.

The "pretrained" encoder is built from its config (random weights) and the corpus is
random token ids with random lengths, so nothing is downloaded.

    python varlen_finetune.py                                  # 10 steps
    python varlen_finetune.py --steps 500 --batch-size 32 --max-len 512
"""

import os

# Variable-length batches fragment the caching allocator: let it grow segments instead.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse
import math
import random
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, Dataset


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=30522)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--nhead", type=int, default=8)
    p.add_argument("--num-layers", type=int, default=6)
    p.add_argument("--dim-feedforward", type=int, default=2048)
    p.add_argument("--num-labels", type=int, default=5)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-ratio", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--empty-cache-every", type=int, default=4)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


# ----------------------------------------------------------------------------- data

PAD_ID, CLS_ID = 0, 101


class RandomTextClassification(Dataset):
    """Token ids of random length in [min_len, max_len] (a [CLS] first) with a label each. Lengths are
    long-tailed as in real text (log-normal, median 2 * min_len), so each batch's longest varies a lot."""

    def __init__(self, num_examples, vocab_size, min_len, max_len, num_labels, seed):
        g = torch.Generator().manual_seed(seed)
        lengths = (2 * min_len * torch.exp(0.6 * torch.randn(num_examples, generator=g))).round()
        self.lengths = lengths.clamp(min_len, max_len).long().tolist()
        self.labels = torch.randint(0, num_labels, (num_examples,), generator=g).tolist()
        self.vocab_size = vocab_size
        self.seed = seed

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, idx):
        g = torch.Generator().manual_seed(self.seed + idx)
        ids = torch.randint(1000, self.vocab_size, (self.lengths[idx] - 1,), generator=g)
        ids = torch.cat([torch.tensor([CLS_ID]), ids])
        return {"input_ids": ids, "label": self.labels[idx]}


def collate_dynamic_padding(features):
    """Pad to the longest sequence of this batch (DataCollatorWithPadding, by hand)."""
    input_ids = pad_sequence([f["input_ids"] for f in features], batch_first=True, padding_value=PAD_ID)
    attention_mask = pad_sequence([torch.ones_like(f["input_ids"]) for f in features], batch_first=True,
                                  padding_value=0)
    labels = torch.tensor([f["label"] for f in features], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


# ----------------------------------------------------------------------------- model


class TransformerClassifier(nn.Module):
    def __init__(self, vocab_size, d_model, nhead, num_layers, dim_feedforward, num_labels, max_len, dropout):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, d_model, padding_idx=PAD_ID)
        self.embed_positions = nn.Embedding(max_len, d_model)
        self.embed_norm = nn.LayerNorm(d_model)
        self.embed_dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, norm=nn.LayerNorm(d_model),
                                             enable_nested_tensor=False)
        self.pre_classifier = nn.Linear(d_model, d_model)
        self.classifier_dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(d_model, num_labels)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()

    def forward(self, input_ids, attention_mask):
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).unsqueeze(0)
        x = self.embed_tokens(input_ids) + self.embed_positions(positions)
        x = self.embed_dropout(self.embed_norm(x))
        x = self.encoder(x, src_key_padding_mask=attention_mask == 0)
        # mean-pool over the real tokens
        mask = attention_mask.unsqueeze(-1).to(x.dtype)
        pooled = (x * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        pooled = F.gelu(self.pre_classifier(pooled))
        return self.classifier(self.classifier_dropout(pooled))


# ----------------------------------------------------------------------------- training


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps):
    def lr_lambda(current_step):
        if current_step < num_warmup_steps:
            return float(current_step) / float(max(1, num_warmup_steps))
        return max(0.0, float(num_training_steps - current_step) / float(max(1, num_training_steps - num_warmup_steps)))

    return LambdaLR(optimizer, lr_lambda)


def main():
    args = parse_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = "cuda"

    dataset = RandomTextClassification(args.steps * args.batch_size, args.vocab_size, args.min_len, args.max_len,
                                       args.num_labels, args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, collate_fn=collate_dynamic_padding,
                        num_workers=0, pin_memory=True, drop_last=True)

    model = TransformerClassifier(args.vocab_size, args.d_model, args.nhead, args.num_layers, args.dim_feedforward,
                                  args.num_labels, args.max_len, args.dropout)
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.1f}M parameters")

    no_decay = ("bias", "norm", "LayerNorm.weight")
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    num_training_steps = args.steps
    scheduler = get_linear_schedule_with_warmup(optimizer, math.ceil(args.warmup_ratio * num_training_steps),
                                                num_training_steps)
    scaler = torch.amp.GradScaler("cuda")

    model.train()
    t0 = time.time()
    for step, batch in enumerate(loader):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            logits = model(batch["input_ids"], batch["attention_mask"])
            loss = F.cross_entropy(logits.float(), batch["labels"])

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        if (step + 1) % args.empty_cache_every == 0:
            torch.cuda.empty_cache()

        if step % args.log_every == 0:
            print(f"step {step:4d} | seq {batch['input_ids'].shape[1]:4d} | loss {loss.item():.4f} | "
                  f"grad_norm {grad_norm.item():.3f} | lr {scheduler.get_last_lr()[0]:.2e} | "
                  f"alloc {torch.cuda.memory_allocated() / 2**20:.0f} MiB | "
                  f"reserved {torch.cuda.memory_reserved() / 2**20:.0f} MiB", flush=True)
        if step + 1 >= args.steps:
            break

    torch.cuda.synchronize()
    print(f"done: {step + 1} steps in {time.time() - t0:.1f}s, "
          f"peak allocated {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB, "
          f"peak reserved {torch.cuda.max_memory_reserved() / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
