#!/usr/bin/env python
"""Swin-T style image classifier, written out by hand as a Kaggle notebook does without timm.

Shifted-window attention: windows cut with ``Tensor.unfold`` and put back with
``view``/``permute``, the shift a ``torch.roll``, attention through
``F.scaled_dot_product_attention`` with the relative-position bias (a learnt
table gathered by an index buffer) plus the shift mask as a float ``attn_mask``.
Training: channels-last inputs, fp16 autocast with ``GradScaler``, CutMix on the
GPU (``torch.distributions.Beta``), label-smoothing cross-entropy, AdamW with
``OneCycleLR`` stepped every batch, clipping after unscale, and an EMA of the
weights by ``torch.optim.swa_utils.AveragedModel`` updated every step, evaluated
at the end.

    python swin_ema_onecycle.py                       # batch 64 of 3x224x224, 3 steps
    python swin_ema_onecycle.py --steps 100 --batch-size 128
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Dataset

torch.backends.cudnn.benchmark = True
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True


# ----------------------------------------------------------------------------- data
class RandomImages(Dataset):
    """Stand-in for an ImageFolder after ToTensor + Normalize."""

    def __init__(self, n, img_size, num_classes):
        self.n, self.img_size, self.num_classes = n, img_size, num_classes

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        img = torch.randn(3, self.img_size, self.img_size, generator=g)
        label = torch.randint(0, self.num_classes, (), generator=g)
        return img, label


# ----------------------------------------------------------------------------- model
class DropPath(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.p = p

    def forward(self, x):
        if self.p == 0.0 or not self.training:
            return x
        keep = 1 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def window_partition(x, ws):
    """(B, H, W, C) -> (B * nW, ws*ws, C) via unfold."""
    B, H, W, C = x.shape
    x = x.unfold(1, ws, ws).unfold(2, ws, ws)  # B, H/ws, W/ws, C, ws, ws
    x = x.permute(0, 1, 2, 4, 5, 3).reshape(-1, ws * ws, C)
    return x


def window_reverse(windows, ws, B, H, W):
    """(B * nW, ws*ws, C) -> (B, H, W, C)."""
    C = windows.shape[-1]
    x = windows.view(B, H // ws, W // ws, ws, ws, C)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(B, H, W, C)
    return x


class WindowAttention(nn.Module):
    def __init__(self, dim, num_heads, ws):
        super().__init__()
        self.num_heads, self.ws = num_heads, ws
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * ws - 1) ** 2, num_heads))
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        rel[:, :, 0] += ws - 1
        rel[:, :, 1] += ws - 1
        rel[:, :, 0] *= 2 * ws - 1
        self.register_buffer("relative_position_index", rel.sum(-1), persistent=False)

    def forward(self, x, mask=None):
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        bias = bias.view(N, N, -1).permute(2, 0, 1).unsqueeze(0)  # 1, heads, N, N
        if mask is not None:
            nW = mask.shape[0]
            bias = (bias + mask.unsqueeze(1)).repeat(B_ // nW, 1, 1, 1)  # B_, heads, N, N
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        x = x.transpose(1, 2).reshape(B_, N, C)
        return self.proj(x)


class SwinBlock(nn.Module):
    def __init__(self, dim, num_heads, res, ws=7, shift=0, mlp_ratio=4.0, drop_path=0.0):
        super().__init__()
        if res <= ws:
            ws, shift = res, 0
        self.res, self.ws, self.shift = res, ws, shift
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, num_heads, ws)
        self.drop_path = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        if shift > 0:
            img_mask = torch.zeros(1, res, res, 1)
            cnt = 0
            for h in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
                for w in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
                    img_mask[:, h, w, :] = cnt
                    cnt += 1
            mw = window_partition(img_mask, ws).squeeze(-1)
            attn_mask = mw.unsqueeze(1) - mw.unsqueeze(2)
            attn_mask = attn_mask.masked_fill(attn_mask != 0, -100.0).masked_fill(attn_mask == 0, 0.0)
        else:
            attn_mask = None
        self.register_buffer("attn_mask", attn_mask, persistent=False)

    def forward(self, x):
        B, L, C = x.shape
        H = W = self.res
        shortcut = x
        x = self.norm1(x).view(B, H, W, C)
        if self.shift > 0:
            x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
        windows = window_partition(x, self.ws)
        windows = self.attn(windows, mask=self.attn_mask)
        x = window_reverse(windows, self.ws, B, H, W)
        if self.shift > 0:
            x = torch.roll(x, shifts=(self.shift, self.shift), dims=(1, 2))
        x = shortcut + self.drop_path(x.reshape(B, L, C))
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return x


class PatchMerging(nn.Module):
    def __init__(self, dim, res):
        super().__init__()
        self.res = res
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x):
        B, L, C = x.shape
        x = x.view(B, self.res, self.res, C)
        x0, x1 = x[:, 0::2, 0::2], x[:, 1::2, 0::2]
        x2, x3 = x[:, 0::2, 1::2], x[:, 1::2, 1::2]
        x = torch.cat([x0, x1, x2, x3], -1).view(B, -1, 4 * C)
        return self.reduction(self.norm(x))


class SwinTiny(nn.Module):
    def __init__(self, num_classes=100, img_size=224, patch=4, embed_dim=96, depths=(2, 2, 6, 2),
                 heads=(3, 6, 12, 24), ws=7, drop_path_rate=0.2):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, embed_dim, patch, patch)
        self.patch_norm = nn.LayerNorm(embed_dim)
        dpr = torch.linspace(0, drop_path_rate, sum(depths)).tolist()
        res, dim, i = img_size // patch, embed_dim, 0
        self.stages = nn.ModuleList()
        for s, (d, h) in enumerate(zip(depths, heads)):
            blocks = [SwinBlock(dim, h, res, ws, 0 if j % 2 == 0 else ws // 2, drop_path=dpr[i + j]) for j in range(d)]
            i += d
            if s < len(depths) - 1:
                blocks.append(PatchMerging(dim, res))
                dim, res = dim * 2, res // 2
            self.stages.append(nn.Sequential(*blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = self.patch_norm(x)
        for stage in self.stages:
            x = stage(x)
        x = self.norm(x).mean(1)
        return self.head(x)


# ----------------------------------------------------------------------------- cutmix
def cutmix(images, targets, beta, prob=0.5):
    """CutMix on the GPU without a host sync: a random box per batch, lambda from Beta(a, a)."""
    if torch.rand(1).item() > prob:
        return images, targets, targets, torch.ones((), device=images.device)
    B, _, H, W = images.shape
    lam = beta.sample()
    perm = torch.randperm(B, device=images.device)
    cut = torch.sqrt(1.0 - lam)
    ch, cw = (cut * H).long(), (cut * W).long()
    cy = torch.randint(0, H, (), device=images.device)
    cx = torch.randint(0, W, (), device=images.device)
    y1, y2 = (cy - ch // 2).clamp(0, H), (cy + ch // 2).clamp(0, H)
    x1, x2 = (cx - cw // 2).clamp(0, W), (cx + cw // 2).clamp(0, W)
    ys = torch.arange(H, device=images.device).view(H, 1)
    xs = torch.arange(W, device=images.device).view(1, W)
    box = (ys >= y1) & (ys < y2) & (xs >= x1) & (xs < x2)
    images = torch.where(box, images[perm], images)
    lam = 1.0 - box.float().mean()
    return images, targets, targets[perm], lam


# ----------------------------------------------------------------------------- main
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--ema-decay", type=float, default=0.999)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()

    device = torch.device("cuda")
    torch.manual_seed(0)

    train_ds = RandomImages(args.batch_size * args.steps, args.img_size, args.num_classes)
    val_ds = RandomImages(args.batch_size, args.img_size, args.num_classes)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=args.workers > 0)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    model = SwinTiny(num_classes=args.num_classes, img_size=args.img_size)
    model = model.to(device, memory_format=torch.channels_last)
    ema_model = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(args.ema_decay), use_buffers=True)
    print(f"params: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M")

    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.ndim <= 1 or name.endswith(".bias") or "relative_position_bias_table" in name:
            no_decay.append(param)
        else:
            decay.append(param)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps,
                                                    pct_start=0.25)
    scaler = torch.amp.GradScaler("cuda")
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    beta = torch.distributions.Beta(torch.tensor(1.0, device=device), torch.tensor(1.0, device=device))

    model.train()
    step = 0
    t0 = time.time()
    while step < args.steps:
        for images, targets in train_loader:
            images = images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            targets = targets.to(device, non_blocking=True)
            images, y_a, y_b, lam = cutmix(images, targets, beta)

            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(images)
                loss = lam * criterion(logits, y_a) + (1.0 - lam) * criterion(logits, y_b)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            ema_model.update_parameters(model)

            step += 1
            print(f"step {step}/{args.steps} loss {loss.item():.4f} grad_norm {grad_norm.item():.3f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e} ({time.time() - t0:.1f}s)")
            if step >= args.steps:
                break

    ema_model.eval()
    correct = total = 0
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        for images, targets in val_loader:
            images = images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            targets = targets.to(device, non_blocking=True)
            correct += (ema_model(images).argmax(1) == targets).sum().item()
            total += targets.numel()
    print(f"EMA val acc {correct / total:.3f}; peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
