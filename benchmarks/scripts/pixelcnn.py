"""Gated-free PixelCNN (van den Oord et al., 2016) on synthetic 8-bit images, 256-way softmax per subpixel."""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MaskedConv2d(nn.Conv2d):
    def __init__(self, mask_type, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("mask", torch.ones_like(self.weight.data))
        kh, kw = self.weight.shape[-2:]
        self.mask[:, :, kh // 2, kw // 2 + (mask_type == "B"):] = 0
        self.mask[:, :, kh // 2 + 1:] = 0

    def forward(self, x):
        self.weight.data *= self.mask
        return super().forward(x)


class ResidualBlock(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.net = nn.Sequential(
            nn.ReLU(), nn.Conv2d(2 * h, h, 1), nn.BatchNorm2d(h),
            nn.ReLU(), MaskedConv2d("B", h, h, 3, padding=1), nn.BatchNorm2d(h),
            nn.ReLU(), nn.Conv2d(h, 2 * h, 1), nn.BatchNorm2d(2 * h),
        )

    def forward(self, x):
        return x + self.net(x)


class PixelCNN(nn.Module):
    def __init__(self, channels=3, h=64, n_layers=8, out_ch=None):
        super().__init__()
        self.channels = channels
        self.inp = MaskedConv2d("A", channels, 2 * h, 7, padding=3, bias=False)
        self.bn = nn.BatchNorm2d(2 * h)
        self.blocks = nn.Sequential(*[ResidualBlock(h) for _ in range(n_layers)])
        self.out = nn.Sequential(
            nn.ReLU(), MaskedConv2d("B", 2 * h, 2 * h, 1), nn.BatchNorm2d(2 * h),
            nn.ReLU(), MaskedConv2d("B", 2 * h, out_ch or 256 * channels, 1),
        )

    def forward(self, x):
        x = self.bn(self.inp(x))
        x = self.blocks(x)
        logits = self.out(x)
        if logits.shape[1] != 256 * self.channels:
            return logits
        b, _, hgt, wid = logits.shape
        return logits.view(b, 256, self.channels, hgt, wid)


def discretized_mix_logistic_loss(x, l):
    """PixelCNN++ loss. x: (B,3,H,W) in [-1,1]; l: (B, 10*nr_mix, H, W)."""
    x, l = x.permute(0, 2, 3, 1), l.permute(0, 2, 3, 1)
    xs, nr_mix = list(x.shape), l.shape[-1] // 10
    logit_probs = l[:, :, :, :nr_mix]
    l = l[:, :, :, nr_mix:].contiguous().view(xs + [nr_mix * 3])
    means = l[:, :, :, :, :nr_mix]
    log_scales = torch.clamp(l[:, :, :, :, nr_mix:2 * nr_mix], min=-7.0)
    coeffs = torch.tanh(l[:, :, :, :, 2 * nr_mix:3 * nr_mix])
    x = x.contiguous().unsqueeze(-1) + torch.zeros(xs + [nr_mix], device=x.device)
    m2 = (means[:, :, :, 1, :] + coeffs[:, :, :, 0, :] * x[:, :, :, 0, :]).view(xs[0], xs[1], xs[2], 1, nr_mix)
    m3 = (means[:, :, :, 2, :] + coeffs[:, :, :, 1, :] * x[:, :, :, 0, :]
          + coeffs[:, :, :, 2, :] * x[:, :, :, 1, :]).view(xs[0], xs[1], xs[2], 1, nr_mix)
    means = torch.cat((means[:, :, :, 0, :].unsqueeze(3), m2, m3), dim=3)
    centered_x = x - means
    inv_stdv = torch.exp(-log_scales)
    plus_in, min_in = inv_stdv * (centered_x + 1.0 / 255.0), inv_stdv * (centered_x - 1.0 / 255.0)
    cdf_plus, cdf_min = torch.sigmoid(plus_in), torch.sigmoid(min_in)
    log_cdf_plus, log_one_minus_cdf_min = plus_in - F.softplus(plus_in), -F.softplus(min_in)
    cdf_delta = cdf_plus - cdf_min
    mid_in = inv_stdv * centered_x
    log_pdf_mid = mid_in - log_scales - 2.0 * F.softplus(mid_in)
    inner = torch.where(cdf_delta > 1e-5, torch.log(torch.clamp(cdf_delta, min=1e-12)), log_pdf_mid - math.log(127.5))
    log_probs = torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, inner))
    log_probs = torch.sum(log_probs, dim=3) + torch.log_softmax(logit_probs, dim=-1)
    return -torch.sum(torch.logsumexp(log_probs, dim=-1)) / (xs[0] * xs[1] * xs[2] * xs[3])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--iters-per-epoch", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--loss", choices=["softmax", "dmol"], default="softmax")  # dmol: PixelCNN++'s, 10 mixtures
    args = parser.parse_args()

    device = "cuda"
    model = PixelCNN(3, args.hidden, args.layers, 100 if args.loss == "dmol" else None).to(device).to(memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.99995)

    for epoch in range(args.epochs):
        model.train()
        for it in range(args.iters_per_epoch):
            imgs = torch.randint(0, 256, (args.batch_size, 3, args.image_size, args.image_size), device=device)
            x = (imgs.float() / 255.0 * 2 - 1).contiguous(memory_format=torch.channels_last)
            logits = model(x)
            loss = discretized_mix_logistic_loss(x, logits) if args.loss == "dmol" else F.cross_entropy(logits, imgs)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            if it % 5 == 0:
                print(f"epoch {epoch} iter {it} nll {loss.item():.4f} bits/dim {loss.item() / math.log(2):.3f}")


if __name__ == "__main__":
    main()
