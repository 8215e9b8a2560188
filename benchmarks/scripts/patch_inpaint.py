"""Patch-based image inpainting: unfold the image into overlapping patches, run
an MLP-Mixer-style token/channel mixer over them, fold back (averaging the
overlaps), upsample a low-res guide with antialiased interpolation."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class MixerBlock(nn.Module):
    def __init__(self, n_tokens, dim, token_hidden, channel_hidden, dropout=0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(nn.Linear(n_tokens, token_hidden), nn.GELU(), nn.Linear(token_hidden, n_tokens))
        self.norm2 = nn.LayerNorm(dim)
        self.channel_mlp = nn.Sequential(nn.Linear(dim, channel_hidden), nn.GELU(), nn.Dropout(dropout),
                                         nn.Linear(channel_hidden, dim))

    def forward(self, x):                                  # B, N, D
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class PatchInpainter(nn.Module):
    def __init__(self, image_size=128, patch=8, stride=4, dim=256, depth=6, channels=3):
        super().__init__()
        self.image_size, self.patch, self.stride = image_size, patch, stride
        self.n_side = (image_size - patch) // stride + 1
        n_tokens = self.n_side ** 2
        patch_dim = (channels + 1 + channels) * patch * patch   # masked image, mask, guide
        self.embed = nn.Linear(patch_dim, dim)
        self.blocks = nn.Sequential(*[MixerBlock(n_tokens, dim, 512, 4 * dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, channels * patch * patch)
        ones = torch.ones(1, 1, image_size, image_size)
        self.register_buffer("overlap", F.fold(F.unfold(ones, patch, stride=stride), image_size, patch, stride=stride))

    def forward(self, img, mask):
        small = F.interpolate(img * (1 - mask), scale_factor=0.25, mode="bilinear", antialias=True, align_corners=False)
        guide = F.interpolate(small, size=img.shape[-2:], mode="bicubic", antialias=True, align_corners=False)
        x = torch.cat([img * (1 - mask), mask, guide], dim=1)
        patches = F.unfold(x, kernel_size=self.patch, stride=self.stride)       # B, C*p*p, N
        tokens = self.embed(patches.transpose(1, 2))
        tokens = self.norm(self.blocks(tokens))
        out = self.out(tokens).transpose(1, 2)                                    # B, 3*p*p, N
        out = F.fold(out, self.image_size, kernel_size=self.patch, stride=self.stride) / self.overlap
        return torch.sigmoid(out)


def random_masks(b, size, device):
    m = torch.zeros(b, 1, size, size, device=device)
    for i in range(b):
        h, w = torch.randint(size // 8, size // 2, (2,)).tolist()
        y, x = torch.randint(0, size - h, (1,)).item(), torch.randint(0, size - w, (1,)).item()
        m[i, :, y:y + h, x:x + w] = 1.0
    return m


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--patch", type=int, default=8)
    p.add_argument("--stride", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()

    device = "cuda"
    torch.backends.cudnn.benchmark = True
    model = PatchInpainter(args.image_size, args.patch, args.stride, args.dim, args.depth).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[50, 80], gamma=0.1)

    for step in range(args.steps):
        img = torch.rand(args.batch_size, 3, args.image_size, args.image_size, device=device)
        mask = random_masks(args.batch_size, args.image_size, device)
        pred = model(img, mask)
        l1_hole = (F.l1_loss(pred, img, reduction="none") * mask).sum() / mask.sum().clamp(min=1) / 3
        l1_valid = (F.l1_loss(pred, img, reduction="none") * (1 - mask)).mean()
        loss = 6.0 * l1_hole + l1_valid
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f} hole {l1_hole.item():.4f} valid {l1_valid.item():.4f}")


if __name__ == "__main__":
    main()
