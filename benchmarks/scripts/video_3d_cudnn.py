#!/usr/bin/env python
"""Video classification with a hand-written R(2+1)D-18, the way torchvision's video
reference and the SlowFast repo train it.

Conv3d / BatchNorm3d (2+1)D residual blocks, clips of (B, 3, 16, 112, 112),
cudnn.benchmark, channels_last_3d model and inputs, bf16 autocast, SGD with
Nesterov momentum, OneCycleLR stepped every iteration, label-smoothing cross
entropy on mixup's soft targets, mixup done on the GPU.

    python video_3d_cudnn.py --steps 10
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

torch.backends.cudnn.benchmark = True


class RandomClips(Dataset):
    """Stands in for decoded, cropped and normalised Kinetics clips: (C, T, H, W) float."""

    def __init__(self, num_samples, clip_len=16, crop=112, num_classes=400):
        self.num_samples, self.clip_len, self.crop, self.num_classes = num_samples, clip_len, crop, num_classes

    def __len__(self):
        return self.num_samples

    def __getitem__(self, idx):
        g = torch.Generator().manual_seed(idx)
        clip = torch.randn(3, self.clip_len, self.crop, self.crop, generator=g)
        label = int(torch.randint(0, self.num_classes, (1,), generator=g))
        return clip, label


class Conv2Plus1D(nn.Sequential):
    """A 3x3x3 convolution factored into a 1x3x3 spatial and a 3x1x1 temporal one (Tran et al. 2018)."""

    def __init__(self, in_planes, out_planes, midplanes, stride=1):
        super().__init__(
            nn.Conv3d(in_planes, midplanes, kernel_size=(1, 3, 3), stride=(1, stride, stride), padding=(0, 1, 1),
                      bias=False),
            nn.BatchNorm3d(midplanes),
            nn.ReLU(inplace=True),
            nn.Conv3d(midplanes, out_planes, kernel_size=(3, 1, 1), stride=(stride, 1, 1), padding=(1, 0, 0),
                      bias=False),
        )


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        midplanes = (inplanes * planes * 3 * 3 * 3) // (inplanes * 3 * 3 + 3 * planes)
        self.conv1 = nn.Sequential(Conv2Plus1D(inplanes, planes, midplanes, stride), nn.BatchNorm3d(planes),
                                   nn.ReLU(inplace=True))
        self.conv2 = nn.Sequential(Conv2Plus1D(planes, planes, midplanes), nn.BatchNorm3d(planes))
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        residual = x if self.downsample is None else self.downsample(x)
        out = self.conv2(self.conv1(x))
        return self.relu(out + residual)


class R2Plus1D(nn.Module):
    def __init__(self, layers=(2, 2, 2, 2), num_classes=400, dropout=0.5):
        super().__init__()
        self.inplanes = 64
        self.stem = nn.Sequential(
            nn.Conv3d(3, 45, kernel_size=(1, 7, 7), stride=(1, 2, 2), padding=(0, 3, 3), bias=False),
            nn.BatchNorm3d(45),
            nn.ReLU(inplace=True),
            nn.Conv3d(45, 64, kernel_size=(3, 1, 1), stride=(1, 1, 1), padding=(1, 0, 0), bias=False),
            nn.BatchNorm3d(64),
            nn.ReLU(inplace=True),
        )
        self.layer1 = self._make_layer(64, layers[0], stride=1)
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2)
        self.layer4 = self._make_layer(512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool3d((1, 1, 1))
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv3d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm3d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)
        for m in self.modules():  # zero-init the last BN of each residual branch
            if isinstance(m, BasicBlock):
                nn.init.zeros_(m.conv2[1].weight)

    def _make_layer(self, planes, blocks, stride):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(
                nn.Conv3d(self.inplanes, planes, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm3d(planes),
            )
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = self.avgpool(x).flatten(1)
        return self.fc(self.dropout(x))


def mixup(clips, targets, num_classes, alpha=0.8, smoothing=0.0):
    """Mixup on the device (timm / SlowFast style): mixes the batch with its flipped self, soft targets."""
    lam = float(torch.distributions.Beta(alpha, alpha).sample())
    one_hot = F.one_hot(targets, num_classes).to(clips.dtype)
    if smoothing:
        one_hot = one_hot * (1.0 - smoothing) + smoothing / num_classes
    clips = clips.mul(lam).add_(clips.flip(0), alpha=1.0 - lam)
    targets = one_hot.mul(lam).add_(one_hot.flip(0), alpha=1.0 - lam)
    return clips, targets


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--clip-len", type=int, default=16)
    p.add_argument("--crop", type=int, default=112)
    p.add_argument("--num-classes", type=int, default=400)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mixup-alpha", type=float, default=0.8)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--print-freq", type=int, default=5)
    return p.parse_args()


def main():
    args = parse_args()
    device = "cuda"
    torch.manual_seed(0)

    dataset = RandomClips(args.batch_size * args.steps, args.clip_len, args.crop, args.num_classes)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=args.workers > 0)

    model = R2Plus1D(num_classes=args.num_classes).to(device)
    model = model.to(memory_format=torch.channels_last_3d)

    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    # no weight decay on BN and bias, as the video reference's --norm-weight-decay 0
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 1e-4}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=args.lr, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps,
                                                    pct_start=0.3)

    model.train()
    step, t0 = 0, time.time()
    while step < args.steps:
        for clips, targets in loader:
            clips = clips.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last_3d)
            targets = targets.to(device, non_blocking=True)
            clips, soft_targets = mixup(clips, targets, args.num_classes, args.mixup_alpha)

            with torch.autocast("cuda", dtype=torch.bfloat16):
                output = model(clips)
                loss = criterion(output, soft_targets)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()

            step += 1
            if step % args.print_freq == 0 or step == args.steps:
                torch.cuda.synchronize()
                dt = (time.time() - t0) / step
                print(f"step {step}/{args.steps} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.4f} "
                      f"{dt * 1000:.0f} ms/it {args.batch_size / dt:.1f} clips/s "
                      f"max mem {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
            if step >= args.steps:
                break


if __name__ == "__main__":
    main()
