#!/usr/bin/env python
"""A DCGAN trained with Lightning's manual optimization, in the style of Lightning's own
GAN example (lightning/examples/pytorch/domain_templates/generative_adversarial_net.py):
two optimizers from ``configure_optimizers``, ``self.automatic_optimization = False``,
``toggle_optimizer`` / ``manual_backward`` / ``step`` / ``zero_grad`` / ``untoggle_optimizer``.

Random images stand in for a data set, so it runs without downloads.

    python lightning_manual_gan.py                                   # 128x128, batch 512, bf16-mixed, GPU
    python lightning_manual_gan.py --image-size 32 --ngf 8 --ndf 8 --batch-size 4 \
        --accelerator cpu --precision 32-true --num-workers 0
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning as L


class RandomImages(Dataset):
    """Images in [-1, 1], like a normalised CelebA crop."""

    def __init__(self, num_samples, channels, image_size, seed=0):
        self.num_samples = num_samples
        self.shape = (channels, image_size, image_size)
        self.seed = seed

    def __len__(self):
        return self.num_samples

    def __getitem__(self, idx):
        g = torch.Generator().manual_seed(self.seed + idx)
        img = torch.rand(self.shape, generator=g) * 2 - 1
        return img, 0  # (image, dummy label), like ImageFolder


class ImageDataModule(L.LightningDataModule):
    def __init__(self, channels=3, image_size=128, batch_size=64, num_samples=4096, num_workers=2):
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage=None):
        hp = self.hparams
        self.train_set = RandomImages(hp.num_samples, hp.channels, hp.image_size)

    def train_dataloader(self):
        return DataLoader(
            self.train_set,
            batch_size=self.hparams.batch_size,
            shuffle=True,
            num_workers=self.hparams.num_workers,
            pin_memory=True,
            drop_last=True,
            persistent_workers=self.hparams.num_workers > 0,
        )


def _n_ups(image_size):
    # 4x4 -> image_size by doubling
    n = 0
    s = 4
    while s < image_size:
        s *= 2
        n += 1
    assert s == image_size, "image size must be a power of two >= 8"
    return n


class Generator(nn.Module):
    def __init__(self, latent_dim=128, ngf=64, channels=3, image_size=128):
        super().__init__()
        n = _n_ups(image_size)
        mult = 2 ** (n - 1)
        layers = [
            nn.ConvTranspose2d(latent_dim, ngf * mult, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * mult),
            nn.ReLU(True),
        ]
        for _ in range(n - 1):
            layers += [
                nn.ConvTranspose2d(ngf * mult, ngf * mult // 2, 4, 2, 1, bias=False),
                nn.BatchNorm2d(ngf * mult // 2),
                nn.ReLU(True),
            ]
            mult //= 2
        layers += [nn.ConvTranspose2d(ngf, channels, 4, 2, 1, bias=False), nn.Tanh()]
        self.main = nn.Sequential(*layers)

    def forward(self, z):
        return self.main(z.view(z.size(0), -1, 1, 1))


class Discriminator(nn.Module):
    def __init__(self, ndf=64, channels=3, image_size=128):
        super().__init__()
        n = _n_ups(image_size)
        layers = [nn.Conv2d(channels, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True)]
        mult = 1
        for _ in range(n - 1):
            layers += [
                nn.Conv2d(ndf * mult, ndf * mult * 2, 4, 2, 1, bias=False),
                nn.BatchNorm2d(ndf * mult * 2),
                nn.LeakyReLU(0.2, inplace=True),
            ]
            mult *= 2
        layers += [nn.Conv2d(ndf * mult, 1, 4, 1, 0, bias=False)]  # logits
        self.main = nn.Sequential(*layers)

    def forward(self, x):
        return self.main(x).view(-1)


def weights_init(m):
    if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif isinstance(m, nn.BatchNorm2d):
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


class GAN(L.LightningModule):
    def __init__(self, channels=3, image_size=128, latent_dim=128, ngf=64, ndf=64, lr=2e-4, b1=0.5, b2=0.999):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False

        self.generator = Generator(latent_dim, ngf, channels, image_size)
        self.discriminator = Discriminator(ndf, channels, image_size)
        self.generator.apply(weights_init)
        self.discriminator.apply(weights_init)

        self.validation_z = torch.randn(8, latent_dim)

    def forward(self, z):
        return self.generator(z)

    def adversarial_loss(self, logits, target):
        return F.binary_cross_entropy_with_logits(logits, target)

    def training_step(self, batch):
        imgs, _ = batch
        opt_g, opt_d = self.optimizers()

        z = torch.randn(imgs.shape[0], self.hparams.latent_dim)
        z = z.type_as(imgs)

        # train generator
        self.toggle_optimizer(opt_g)
        self.generated_imgs = self(z)
        valid = torch.ones(imgs.size(0)).type_as(imgs)
        g_loss = self.adversarial_loss(self.discriminator(self.generated_imgs), valid)
        self.log("g_loss", g_loss, prog_bar=True)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        # train discriminator
        self.toggle_optimizer(opt_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
        fake = torch.zeros(imgs.size(0)).type_as(imgs)
        fake_loss = self.adversarial_loss(self.discriminator(self.generated_imgs.detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        self.log("d_loss", d_loss, prog_bar=True)
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self):
        lr, b1, b2 = self.hparams.lr, self.hparams.b1, self.hparams.b2
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
        return [opt_g, opt_d], []


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--channels", type=int, default=3)
    p.add_argument("--latent-dim", type=int, default=128)
    p.add_argument("--ngf", type=int, default=64)
    p.add_argument("--ndf", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--accelerator", default="gpu")
    p.add_argument("--precision", default="bf16-mixed")
    return p.parse_args()


def main():
    args = parse_args()
    L.seed_everything(42)
    dm = ImageDataModule(args.channels, args.image_size, args.batch_size, num_workers=args.num_workers)
    model = GAN(args.channels, args.image_size, args.latent_dim, args.ngf, args.ndf)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        precision=args.precision,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=True,
        log_every_n_steps=1,
    )
    trainer.fit(model, dm)


if __name__ == "__main__":
    main()
