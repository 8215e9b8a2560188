#!/usr/bin/env python
"""WGAN with gradient penalty, written the way the PyTorch-GAN collection writes it.

Two models and two Adam optimizers; the critic steps every iteration and the
generator every ``--n-critic``; the legacy tensor types
(``Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor``), data
through numpy, and ``autograd.grad(..., create_graph=True)`` for the penalty.
Random images stand in for a dataset, so it runs offline.

    python wgan_gp.py --img-size 64 --batch-size 64
"""

import argparse

import numpy as np
import torch
import torch.autograd as autograd
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--n-epochs", type=int, default=200)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--lr", type=float, default=0.0002)
parser.add_argument("--latent-dim", type=int, default=100)
parser.add_argument("--img-size", type=int, default=64)
parser.add_argument("--channels", type=int, default=3)
parser.add_argument("--hidden", type=int, default=1024)
parser.add_argument("--n-critic", type=int, default=5)
parser.add_argument("--batches", type=int, default=20)
opt = parser.parse_args()

img_shape = (opt.channels, opt.img_size, opt.img_size)
cuda = True if torch.cuda.is_available() else False


class Generator(nn.Module):
    def __init__(self):
        super().__init__()

        def block(in_feat, out_feat, normalize=True):
            layers = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        h = opt.hidden
        self.model = nn.Sequential(
            *block(opt.latent_dim, h // 8, normalize=False),
            *block(h // 8, h // 4),
            *block(h // 4, h // 2),
            *block(h // 2, h),
            nn.Linear(h, int(np.prod(img_shape))),
            nn.Tanh(),
        )

    def forward(self, z):
        img = self.model(z)
        return img.view(img.shape[0], *img_shape)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        h = opt.hidden
        self.model = nn.Sequential(
            nn.Linear(int(np.prod(img_shape)), h // 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(h // 2, h // 4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(h // 4, 1),
        )

    def forward(self, img):
        return self.model(img.view(img.shape[0], -1))


lambda_gp = 10
generator = Generator()
discriminator = Discriminator()
if cuda:
    generator.cuda()
    discriminator.cuda()

optimizer_G = torch.optim.Adam(generator.parameters(), lr=opt.lr, betas=(0.5, 0.999))
optimizer_D = torch.optim.Adam(discriminator.parameters(), lr=opt.lr, betas=(0.5, 0.999))
Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor


def compute_gradient_penalty(D, real_samples, fake_samples):
    """Gradient penalty for WGAN GP."""
    alpha = Tensor(np.random.random((real_samples.size(0), 1, 1, 1)))
    interpolates = (alpha * real_samples + ((1 - alpha) * fake_samples)).requires_grad_(True)
    d_interpolates = D(interpolates)
    fake = Tensor(real_samples.shape[0], 1).fill_(1.0)
    gradients = autograd.grad(outputs=d_interpolates, inputs=interpolates, grad_outputs=fake,
                              create_graph=True, retain_graph=True, only_inputs=True)[0]
    gradients = gradients.view(gradients.size(0), -1)
    return ((gradients.norm(2, dim=1) - 1) ** 2).mean()


batches_done = 0
for epoch in range(opt.n_epochs):
    for i in range(opt.batches):
        imgs = torch.rand(opt.batch_size, *img_shape) * 2 - 1
        real_imgs = imgs.type(Tensor)

        optimizer_D.zero_grad()
        z = Tensor(np.random.normal(0, 1, (imgs.shape[0], opt.latent_dim)))
        fake_imgs = generator(z)
        real_validity = discriminator(real_imgs)
        fake_validity = discriminator(fake_imgs)
        gradient_penalty = compute_gradient_penalty(discriminator, real_imgs.data, fake_imgs.data)
        d_loss = -torch.mean(real_validity) + torch.mean(fake_validity) + lambda_gp * gradient_penalty
        d_loss.backward()
        optimizer_D.step()

        optimizer_G.zero_grad()
        if i % opt.n_critic == 0:
            fake_imgs = generator(z)
            fake_validity = discriminator(fake_imgs)
            g_loss = -torch.mean(fake_validity)
            g_loss.backward()
            optimizer_G.step()
            print(f"[Epoch {epoch}/{opt.n_epochs}] [Batch {i}/{opt.batches}] [D loss: {d_loss.item():f}] "
                  f"[G loss: {g_loss.item():f}]")
            batches_done += opt.n_critic
