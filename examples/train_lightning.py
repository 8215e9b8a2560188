#!/usr/bin/env python
"""A GPT-style model trained with Lightning, memprof tracking it and advising on it.

    python examples/train_lightning.py                                   # small, on this machine
    python examples/train_lightning.py --budget 12GiB --target rtx3060   # + plans as Trainer settings
    python examples/train_lightning.py --n-layer 12 --d-model 768 --n-head 12 --seq-len 1024 \
        --vocab-size 50304 --batch-size 16 --precision bf16-mixed --budget 24GiB           # GPT-2 size, on a GPU

MemprofCallback logs the memory by category to the trainer's loggers (here a
CSVLogger in --out), saves the report, and with --budget ranks the memory
plans for this fit's own step after the warm-up steps, printed as Trainer
settings (precision, accumulate_grad_batches, checkpointing, strategies).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning as L
from lightning.pytorch.loggers import CSVLogger

from memprof.callbacks import MemprofCallback


class RandomTokens(Dataset):
    def __init__(self, n, seq_len, vocab_size):
        self.data = torch.randint(0, vocab_size, (n, seq_len + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1], self.data[i, 1:]


class GPT(L.LightningModule):
    def __init__(self, vocab_size=8192, seq_len=128, n_layer=4, d_model=256, n_head=4, lr=3e-4):
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(n_layer)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    p.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, 16-mixed, ...")
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--budget", default=None, help="device memory per rank the plans must fit, e.g. 24GiB or rtx4090")
    p.add_argument("--target", default=None, help="GPU of memprof's catalogue to simulate for the advice")
    p.add_argument("--out", default="lightning_logs_memprof")
    args = p.parse_args()

    model = GPT(vocab_size=args.vocab_size, seq_len=args.seq_len, n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head)
    data = DataLoader(RandomTokens(args.batch_size * args.accumulate * args.max_steps, args.seq_len, args.vocab_size),
                      batch_size=args.batch_size, shuffle=True)
    memprof_cb = MemprofCallback(warmup=2, every=2, save_path=f"{args.out}/memprof.json",
                                 budget=args.budget, target=args.target)
    trainer = L.Trainer(max_steps=args.max_steps, accelerator=args.accelerator, precision=args.precision,
                        accumulate_grad_batches=args.accumulate, logger=CSVLogger(args.out), callbacks=[memprof_cb],
                        enable_checkpointing=False, log_every_n_steps=1)
    trainer.fit(model, data)


if __name__ == "__main__":
    main()
