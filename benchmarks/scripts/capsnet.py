"""CapsNet (Sabour et al., 2017) on MNIST-shaped synthetic data.

Dynamic routing between capsules, margin loss and a reconstruction decoder,
in the style of the popular gram-ai / XifengGuo PyTorch ports.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


def squash(s, dim=-1):
    sq = (s ** 2).sum(dim=dim, keepdim=True)
    return sq / (1.0 + sq) * s / torch.sqrt(sq + 1e-8)


class PrimaryCaps(nn.Module):
    def __init__(self, in_ch=256, caps=32, dim=8):
        super().__init__()
        self.dim = dim
        self.conv = nn.Conv2d(in_ch, caps * dim, kernel_size=9, stride=2)

    def forward(self, x):
        out = self.conv(x)                                   # B, 256, 6, 6
        out = out.view(x.size(0), -1, self.dim, out.size(-2), out.size(-1))
        out = out.permute(0, 1, 3, 4, 2).contiguous().view(x.size(0), -1, self.dim)
        return squash(out)                                   # B, 1152, 8


class DigitCaps(nn.Module):
    def __init__(self, in_caps=1152, in_dim=8, out_caps=10, out_dim=16, iters=3):
        super().__init__()
        self.iters = iters
        self.W = nn.Parameter(0.01 * torch.randn(1, in_caps, out_caps, out_dim, in_dim))

    def forward(self, u):
        u = u[:, :, None, :, None]                           # B, 1152, 1, 8, 1
        u_hat = torch.matmul(self.W, u).squeeze(-1)          # B, 1152, 10, 16
        b = torch.zeros(u_hat.shape[:3], device=u.device)    # B, 1152, 10
        for i in range(self.iters):
            c = F.softmax(b, dim=2)
            s = (c.unsqueeze(-1) * u_hat).sum(dim=1)         # B, 10, 16
            v = squash(s)
            if i < self.iters - 1:
                b = b + (u_hat * v.unsqueeze(1)).sum(dim=-1)
        return v


class CapsNet(nn.Module):
    def __init__(self, routing_iters=3):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 256, kernel_size=9)
        self.primary = PrimaryCaps()
        self.digits = DigitCaps(iters=routing_iters)
        self.decoder = nn.Sequential(
            nn.Linear(16 * 10, 512), nn.ReLU(inplace=True),
            nn.Linear(512, 1024), nn.ReLU(inplace=True),
            nn.Linear(1024, 784), nn.Sigmoid(),
        )

    def forward(self, x, y=None):
        h = F.relu(self.conv1(x))
        v = self.digits(self.primary(h))                     # B, 10, 16
        lengths = v.norm(dim=-1)
        if y is None:
            y = lengths.argmax(dim=1)
        mask = F.one_hot(y, 10).float()
        recon = self.decoder((v * mask[:, :, None]).flatten(1))
        return lengths, recon.view(-1, 1, 28, 28)


def margin_loss(lengths, y, m_pos=0.9, m_neg=0.1, lam=0.5):
    t = F.one_hot(y, 10).float()
    l = t * F.relu(m_pos - lengths) ** 2 + lam * (1 - t) * F.relu(lengths - m_neg) ** 2
    return l.sum(dim=1).mean()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps-per-epoch", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-decay", type=float, default=0.96)
    p.add_argument("--routing", type=int, default=3)
    p.add_argument("--recon-weight", type=float, default=0.0005)
    args = p.parse_args()

    device = "cuda"
    model = CapsNet(args.routing).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=args.lr_decay)

    for epoch in range(args.epochs):
        model.train()
        total = 0.0
        for it in range(args.steps_per_epoch):
            images = torch.rand(args.batch_size, 1, 28, 28, device=device)
            labels = torch.randint(0, 10, (args.batch_size,), device=device)
            optimizer.zero_grad()
            lengths, recon = model(images, labels)
            loss = margin_loss(lengths, labels) + args.recon_weight * F.mse_loss(recon, images, reduction="sum")
            loss.backward()
            optimizer.step()
            total += loss.item()
            if it % 10 == 0:
                acc = (lengths.argmax(1) == labels).float().mean().item()
                print(f"epoch {epoch} it {it} loss {loss.item():.4f} acc {acc:.3f}")
        scheduler.step()
        print(f"epoch {epoch} mean loss {total / args.steps_per_epoch:.4f} lr {scheduler.get_last_lr()[0]:.2e}")


if __name__ == "__main__":
    main()
