"""Lazy modules (shapes inferred at the first forward), a streaming IterableDataset sharded by worker, a tqdm bar and bf16 autocast."""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from tqdm import tqdm


class SyntheticImageStream(IterableDataset):
    """An endless stream of (image, label) pairs, as a sharded web dataset would give them.

    Each DataLoader worker takes every num_workers-th sample, so the workers never
    repeat each other's samples."""

    def __init__(self, image_size, num_classes, seed=0, length=None):
        super().__init__()
        self.image_size = image_size
        self.num_classes = num_classes
        self.seed = seed
        self.length = length

    def __iter__(self):
        worker_info = get_worker_info()
        if worker_info is None:
            worker_id, num_workers = 0, 1
        else:
            worker_id, num_workers = worker_info.id, worker_info.num_workers
        index = worker_id
        while self.length is None or index < self.length:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
            image = torch.randn(3, self.image_size, self.image_size, generator=g)
            label = int(torch.randint(self.num_classes, (1,), generator=g))
            yield image, label
            index += num_workers


def conv_bn(out_channels, stride=1):
    return nn.Sequential(
        nn.LazyConv2d(out_channels, kernel_size=3, stride=stride, padding=1, bias=False),
        nn.LazyBatchNorm2d(),
        nn.ReLU(inplace=True),
    )


class LazyNet(nn.Module):
    """A VGG-ish conv net whose input channels are never written down: lazy modules infer them."""

    def __init__(self, widths, num_classes):
        super().__init__()
        layers = []
        for i, w in enumerate(widths):
            layers.append(conv_bn(w, stride=1 if i == 0 else 2))
            layers.append(conv_bn(w))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Sequential(nn.Flatten(), nn.LazyLinear(512), nn.ReLU(inplace=True), nn.Dropout(0.2),
                                  nn.LazyLinear(num_classes))

    def forward(self, x):
        return self.head(self.pool(self.features(x)))


def main():
    parser = argparse.ArgumentParser(description="Lazy conv net on a streaming dataset")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--widths", type=str, default="64,128,256,512")
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = "cuda"
    torch.backends.cudnn.benchmark = True

    widths = [int(w) for w in args.widths.split(",")]
    model = LazyNet(widths, args.num_classes).to(device)

    # Lazy modules: run a dry forward so that every parameter is materialised
    # before the optimizer sees them (torch.nn.modules.lazy.LazyModuleMixin docs).
    with torch.no_grad():
        model(torch.zeros(2, 3, args.image_size, args.image_size, device=device))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters after the dry run, has_uninitialized_params="
          f"{any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters())}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / max(args.steps, 1))))

    dataset = SyntheticImageStream(args.image_size, args.num_classes, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, num_workers=args.num_workers,
                        pin_memory=True, drop_last=True,
                        persistent_workers=args.num_workers > 0)

    model.train()
    data_iter = iter(loader)
    t0 = time.time()
    pbar = tqdm(range(args.steps), desc="train", dynamic_ncols=True)
    for step in pbar:
        images, labels = next(data_iter)
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)

        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(images)
            loss = F.cross_entropy(logits, labels, label_smoothing=0.1)

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()

        acc = (logits.argmax(dim=1) == labels).float().mean()
        pbar.set_postfix(loss=f"{loss.item():.4f}", acc=f"{acc.item():.3f}",
                         lr=f"{scheduler.get_last_lr()[0]:.2e}",
                         mem=f"{torch.cuda.max_memory_allocated() / 2**30:.2f}G")
    pbar.close()
    elapsed = time.time() - t0
    print(f"done: {args.steps} steps in {elapsed:.1f}s, {args.steps * args.batch_size / elapsed:.1f} img/s, "
          f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated")


if __name__ == "__main__":
    main()
