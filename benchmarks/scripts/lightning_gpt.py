#!/usr/bin/env python
"""A GPT-style language model trained with Lightning on random tokens.

    python lightning_gpt.py                                          # ~124M params, bf16-mixed
    python lightning_gpt.py --n-layer 2 --d-model 64 --n-head 4 --seq-len 32 \
        --batch-size 4 --accelerator cpu --precision 32-true
"""

import argparse
import math
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning as L
from lightning.pytorch.callbacks import Callback, LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger


class RandomTokenDataset(Dataset):
    def __init__(self, num_samples, seq_len, vocab_size, seed=0):
        generator = torch.Generator().manual_seed(seed)
        # one extra token per row so inputs and shifted targets come from the same block
        self.data = torch.randint(0, vocab_size, (num_samples, seq_len + 1), generator=generator)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx):
        block = self.data[idx]
        return block[:-1], block[1:]


class TokenDataModule(L.LightningDataModule):
    def __init__(self, vocab_size, seq_len, batch_size, num_train, num_val, num_workers=0):
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage=None):
        hp = self.hparams
        self.train_set = RandomTokenDataset(hp.num_train, hp.seq_len, hp.vocab_size, seed=0)
        self.val_set = RandomTokenDataset(hp.num_val, hp.seq_len, hp.vocab_size, seed=1)

    def train_dataloader(self):
        return DataLoader(
            self.train_set,
            batch_size=self.hparams.batch_size,
            shuffle=True,
            num_workers=self.hparams.num_workers,
            pin_memory=True,
            drop_last=True,
        )

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)


class GPT(nn.Module):
    """Decoder-only transformer: token + learned position embeddings, pre-LN blocks, tied head."""

    def __init__(self, vocab_size, seq_len, d_model, n_head, n_layer, dropout=0.1):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(
            d_model,
            n_head,
            dim_feedforward=4 * d_model,
            dropout=dropout,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=idx.device)
        x = self.blocks(x, mask=mask, is_causal=True)
        return self.head(self.ln_f(x))


class LitGPT(L.LightningModule):
    def __init__(
        self,
        vocab_size=50304,
        seq_len=512,
        d_model=768,
        n_head=12,
        n_layer=12,
        dropout=0.1,
        learning_rate=6e-4,
        weight_decay=0.1,
        warmup_steps=2,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(vocab_size, seq_len, d_model, n_head, n_layer, dropout)

    def forward(self, idx):
        return self.model(idx)

    def _loss(self, batch):
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        # no weight decay for biases, norms and embeddings
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            (decay if p.dim() >= 2 and "emb" not in name else no_decay).append(p)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams.learning_rate,
            betas=(0.9, 0.95),
        )

        total_steps = self.trainer.estimated_stepping_batches
        warmup = self.hparams.warmup_steps

        def lr_lambda(step):
            if step < warmup:
                return (step + 1) / warmup
            progress = (step - warmup) / max(1, total_steps - warmup)
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }


class PrintMetrics(Callback):
    """Progress bar is off, so print the logged loss once per optimizer step."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            loss = trainer.callback_metrics.get("train_loss")
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            print(f"step {trainer.global_step:4d} | loss {loss.item():.4f} | lr {lr:.2e}")


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab-size", type=int, default=50304)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--accumulate-grad-batches", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--limit-val-batches", type=int, default=2)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--devices", default=1)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--strategy", default="auto", help="e.g. ddp (one process per device)")
    parser.add_argument("--log-dir", default=None)
    return parser.parse_args()


def main():
    args = parse_args()
    L.seed_everything(42)
    torch.set_float32_matmul_precision("high")

    micro_batches = args.max_steps * args.accumulate_grad_batches
    datamodule = TokenDataModule(
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        num_train=micro_batches * args.batch_size,
        num_val=max(1, args.limit_val_batches) * args.batch_size,
        num_workers=args.num_workers,
    )
    model = LitGPT(
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_head=args.n_head,
        n_layer=args.n_layer,
        dropout=args.dropout,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
    )

    logger = CSVLogger(args.log_dir or tempfile.mkdtemp(prefix="lightning_logs_"), name="gpt")
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate_grad_batches,
        gradient_clip_val=1.0,
        limit_val_batches=args.limit_val_batches,
        num_sanity_val_steps=0,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[LearningRateMonitor(logging_interval="step"), PrintMetrics()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=True,
    )
    trainer.fit(model, datamodule=datamodule)

    print({k: f"{v.item():.4g}" for k, v in trainer.callback_metrics.items()})
    print(f"logs written to {logger.log_dir}")


if __name__ == "__main__":
    main()
