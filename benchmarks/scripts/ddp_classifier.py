#!/usr/bin/env python
"""Image classification with DistributedDataParallel, written for torchrun.

A small ResNet defined here, synchronised batch norm, a DistributedSampler, bf16
autocast, SGD with Nesterov momentum and a one-cycle schedule, the loss averaged
across ranks for the log. Random images stand in for a dataset, so it runs offline.

    torchrun --nproc_per_node=8 ddp_classifier.py      # one process per GPU
    python ddp_classifier.py                          # one process (world size 1)
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.short(x))


class ResNet(nn.Module):
    def __init__(self, widths=(64, 128, 256, 512), depth=2, num_classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 7, 2, 3, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        layers, cin = [], widths[0]
        for i, w in enumerate(widths):
            for j in range(depth):
                layers.append(BasicBlock(cin, w, 2 if j == 0 and i > 0 else 1))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def parse_args():
    p = argparse.ArgumentParser(description="DDP image classification on random images")
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=2, help="blocks per stage")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--workers", type=int, default=2)
    return p.parse_args()


def main():
    args = parse_args()
    # torchrun sets these; a plain `python ddp_classifier.py` is one rank of one
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dist.init_process_group(backend="nccl")
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    w = args.width
    model = ResNet((w, 2 * w, 4 * w, 8 * w), args.depth, args.num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank])
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 5e-5}, {"params": no_decay, "weight_decay": 0}],
                                lr=args.lr, momentum=0.9, nesterov=True)

    data = TensorDataset(torch.randn(args.samples, 3, args.image_size, args.image_size),
                         torch.randint(0, args.num_classes, (args.samples,)))
    sampler = DistributedSampler(data, shuffle=True, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=args.workers > 0)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(loader))
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1).to(device)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, (images, target) in enumerate(loader):
            images = images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            target = target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(images), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if i % 4 == 0:
                reduced = loss.detach().clone()
                dist.all_reduce(reduced, op=dist.ReduceOp.AVG)
                if dist.get_rank() == 0:
                    print(f"epoch {epoch} step {i}: loss {reduced.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
