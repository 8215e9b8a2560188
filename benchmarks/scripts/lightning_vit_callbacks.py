#!/usr/bin/env python
"""A small ViT image classifier trained with Lightning, the way tutorials write it.

LightningModule + LightningDataModule on random images, ``nn.TransformerEncoderLayer``
(batch_first, pre-norm) blocks, AdamW with ReduceLROnPlateau on ``val_loss``,
bf16-mixed, gradient accumulation and clipping, validation every few batches,
ModelCheckpoint monitoring ``val_loss`` and LearningRateMonitor.

    python lightning_vit_callbacks.py --steps 10
"""

import argparse
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger


class RandomImageDataModule(L.LightningDataModule):
    def __init__(self, image_size=128, num_classes=100, batch_size=32, num_train=256, num_val=64, num_workers=0):
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage=None):
        hp = self.hparams
        g = torch.Generator().manual_seed(0)
        self.train_set = TensorDataset(
            torch.randn(hp.num_train, 3, hp.image_size, hp.image_size, generator=g),
            torch.randint(0, hp.num_classes, (hp.num_train,), generator=g),
        )
        self.val_set = TensorDataset(
            torch.randn(hp.num_val, 3, hp.image_size, hp.image_size, generator=g),
            torch.randint(0, hp.num_classes, (hp.num_val,), generator=g),
        )

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True,
                          num_workers=self.hparams.num_workers, pin_memory=True, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, shuffle=False,
                          num_workers=self.hparams.num_workers, pin_memory=True)


class PatchEmbed(nn.Module):
    def __init__(self, image_size, patch_size, in_chans, embed_dim):
        super().__init__()
        self.num_patches = (image_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        x = self.proj(x)  # B, D, H/p, W/p
        return x.flatten(2).transpose(1, 2)  # B, N, D


class ViT(nn.Module):
    def __init__(self, image_size=128, patch_size=16, in_chans=3, num_classes=100, embed_dim=384, depth=6,
                 num_heads=6, mlp_ratio=4.0, dropout=0.1):
        super().__init__()
        self.patch_embed = PatchEmbed(image_size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, embed_dim))
        self.pos_drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([
            nn.TransformerEncoderLayer(embed_dim, num_heads, dim_feedforward=int(embed_dim * mlp_ratio),
                                       dropout=dropout, activation="gelu", batch_first=True, norm_first=True)
            for _ in range(depth)
        ])
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def forward(self, x):
        x = self.patch_embed(x)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat((cls, x), dim=1) + self.pos_embed
        x = self.pos_drop(x)
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        return self.head(x[:, 0])


class LitViT(L.LightningModule):
    def __init__(self, lr=3e-4, weight_decay=0.05, **vit_kwargs):
        super().__init__()
        self.save_hyperparameters()
        self.model = ViT(**vit_kwargs)

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y, label_smoothing=0.1)
        acc = (logits.argmax(dim=-1) == y).float().mean()
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.log("train_acc", acc, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(dim=-1) == y).float().mean()
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_acc", acc, prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=2)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"},
        }


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (max_steps)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--patch-size", type=int, default=16)
    p.add_argument("--embed-dim", type=int, default=384)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--num-heads", type=int, default=6)
    p.add_argument("--num-classes", type=int, default=100)
    p.add_argument("--accumulate", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    return p.parse_args(argv)


def build(args, extra_callbacks=(), accelerator="gpu"):
    L.seed_everything(42)
    num_batches = args.steps * args.accumulate
    datamodule = RandomImageDataModule(image_size=args.image_size, num_classes=args.num_classes,
                                       batch_size=args.batch_size, num_train=num_batches * args.batch_size,
                                       num_val=2 * args.batch_size)
    model = LitViT(lr=args.lr, image_size=args.image_size, patch_size=args.patch_size,
                   num_classes=args.num_classes, embed_dim=args.embed_dim, depth=args.depth,
                   num_heads=args.num_heads)
    tmp = tempfile.mkdtemp(prefix="vit_ckpt_")
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        precision="bf16-mixed",
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=1.0,
        max_steps=args.steps,
        val_check_interval=5,
        limit_val_batches=2,
        callbacks=[ModelCheckpoint(monitor="val_loss", dirpath=tmp), LearningRateMonitor(), *extra_callbacks],
        # LearningRateMonitor refuses a Trainer without a logger (logger=False raises MisconfigurationException)
        logger=CSVLogger(tmp, name="logs"),
        enable_progress_bar=False,
    )
    return model, datamodule, trainer


def main():
    args = parse_args()
    model, datamodule, trainer = build(args)
    trainer.fit(model, datamodule=datamodule)
    print({k: round(float(v), 4) for k, v in trainer.callback_metrics.items()})


if __name__ == "__main__":
    main()
