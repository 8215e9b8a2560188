"""StyleGAN2-lite (after rosinality/stylegan2-pytorch): modulated convs, lazy R1, EMA generator."""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

class EqualLinear(nn.Module):
    def __init__(self, in_dim, out_dim, bias_init=0.0, lr_mul=1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_dim, in_dim) / lr_mul)
        self.bias = nn.Parameter(torch.full((out_dim,), float(bias_init)))
        self.scale, self.lr_mul = lr_mul / math.sqrt(in_dim), lr_mul

    def forward(self, x):
        return F.linear(x, self.weight * self.scale, self.bias * self.lr_mul)

class ModulatedConv(nn.Module):
    def __init__(self, in_ch, out_ch, k, style_dim, demodulate=True, upsample=False):
        super().__init__()
        self.out_ch, self.k, self.upsample, self.demodulate = out_ch, k, upsample, demodulate
        self.weight, self.scale = nn.Parameter(torch.randn(1, out_ch, in_ch, k, k)), 1 / math.sqrt(in_ch * k * k)
        self.modulation = EqualLinear(style_dim, in_ch, bias_init=1.0)

    def forward(self, x, style):
        b, c = x.shape[:2]
        weight = self.scale * self.weight * self.modulation(style).view(b, 1, c, 1, 1)   # B, O, I, k, k
        if self.demodulate:
            d = torch.rsqrt(weight.pow(2).sum([2, 3, 4]) + 1e-8)
            weight = weight * d.view(b, self.out_ch, 1, 1, 1)
        weight = weight.view(b * self.out_ch, c, self.k, self.k)
        if self.upsample:
            x = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
        out = F.conv2d(x.reshape(1, b * c, *x.shape[2:]), weight, padding=self.k // 2, groups=b)
        return out.view(b, self.out_ch, *out.shape[2:])

class StyledLayer(nn.Module):
    def __init__(self, in_ch, out_ch, style_dim, upsample=False):
        super().__init__()
        self.conv = ModulatedConv(in_ch, out_ch, 3, style_dim, upsample=upsample)
        self.noise_strength, self.bias = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1, out_ch, 1, 1))

    def forward(self, x, w):
        x = self.conv(x, w)
        x = x + self.noise_strength * torch.randn(x.size(0), 1, x.size(2), x.size(3), device=x.device)
        return F.leaky_relu(x + self.bias, 0.2) * math.sqrt(2)

class Generator(nn.Module):
    def __init__(self, size=64, style_dim=256, ch=256, n_mlp=4):
        super().__init__()
        self.style_dim = style_dim
        self.mapping = nn.Sequential(*[m for _ in range(n_mlp) for m in
                                       (EqualLinear(style_dim, style_dim, lr_mul=0.01), nn.LeakyReLU(0.2))])
        self.const = nn.Parameter(torch.randn(1, ch, 4, 4))
        self.layers = nn.ModuleList([StyledLayer(ch, ch, style_dim)])
        self.to_rgbs = nn.ModuleList([ModulatedConv(ch, 3, 1, style_dim, demodulate=False)])
        for _ in range(int(math.log2(size)) - 2):
            self.layers.extend([StyledLayer(ch, ch, style_dim, upsample=True), StyledLayer(ch, ch, style_dim)])
            self.to_rgbs.append(ModulatedConv(ch, 3, 1, style_dim, demodulate=False))

    def forward(self, z):
        w = self.mapping(F.normalize(z, dim=1) * math.sqrt(self.style_dim))
        x = self.layers[0](self.const.expand(z.size(0), -1, -1, -1), w)
        rgb = self.to_rgbs[0](x, w)
        for i in range(1, len(self.layers), 2):
            x = self.layers[i + 1](self.layers[i](x, w), w)
            rgb = F.interpolate(rgb, scale_factor=2, mode="bilinear", align_corners=False) + self.to_rgbs[(i + 1) // 2](x, w)
        return rgb

def discriminator(size=64, ch=256):
    blocks = [nn.Conv2d(3, ch, 1), nn.LeakyReLU(0.2)]
    for _ in range(int(math.log2(size)) - 2):
        blocks += [nn.Conv2d(ch, ch, 3, padding=1), nn.LeakyReLU(0.2), nn.Conv2d(ch, ch, 3, padding=1, stride=2), nn.LeakyReLU(0.2)]
    return nn.Sequential(*blocks, nn.Flatten(), nn.Linear(ch * 16, ch), nn.LeakyReLU(0.2), nn.Linear(ch, 1))

def main():
    p = argparse.ArgumentParser()
    for flag, default in [("--size", 64), ("--batch", 16), ("--channels", 256), ("--lr", 0.002), ("--r1", 10.0),
                          ("--d-reg-every", 4), ("--ema-decay", 0.999), ("--iters", 100)]:
        p.add_argument(flag, type=type(default), default=default)
    args = p.parse_args()

    device = "cuda"
    G = Generator(args.size, ch=args.channels).to(device)
    D = discriminator(args.size, ch=args.channels).to(device)
    G_ema = copy.deepcopy(G).eval().requires_grad_(False)
    d_ratio = args.d_reg_every / (args.d_reg_every + 1)
    g_optim = torch.optim.Adam(G.parameters(), lr=args.lr, betas=(0.0, 0.99))
    d_optim = torch.optim.Adam(D.parameters(), lr=args.lr * d_ratio, betas=(0.0, 0.99 ** d_ratio))

    for i in range(args.iters):
        real = torch.rand(args.batch, 3, args.size, args.size, device=device) * 2 - 1
        G.requires_grad_(False); D.requires_grad_(True)
        fake = G(torch.randn(args.batch, 256, device=device))
        d_loss = F.softplus(D(fake)).mean() + F.softplus(-D(real)).mean()
        D.zero_grad(set_to_none=True)
        d_loss.backward()
        d_optim.step()
        if i % args.d_reg_every == 0:                          # lazy R1 on reals
            real.requires_grad_(True)
            real_pred = D(real)
            grad, = torch.autograd.grad(real_pred.sum(), real, create_graph=True)
            r1 = grad.pow(2).reshape(grad.size(0), -1).sum(1).mean()
            D.zero_grad(set_to_none=True)
            (args.r1 / 2 * r1 * args.d_reg_every + 0 * real_pred[0]).sum().backward()
            d_optim.step()
        G.requires_grad_(True); D.requires_grad_(False)
        g_loss = F.softplus(-D(G(torch.randn(args.batch, 256, device=device)))).mean()
        G.zero_grad(set_to_none=True)
        g_loss.backward()
        g_optim.step()
        with torch.no_grad():                                  # EMA of the generator
            for p_ema, p_g in zip(G_ema.parameters(), G.parameters()):
                p_ema.lerp_(p_g, 1 - args.ema_decay)
        if i % 10 == 0: print(f"iter {i} d {d_loss.item():.4f} g {g_loss.item():.4f}")

if __name__ == "__main__":
    main()
