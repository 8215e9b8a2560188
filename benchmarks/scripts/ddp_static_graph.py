"""DDP for torchrun with static_graph, gradient_as_bucket_view, a bf16 compression comm hook, SyncBatchNorm, no_sync() accumulation and fp16 GradScaler."""

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


def conv_bn(cin, cout, stride=1):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class ConvNet(nn.Module):
    def __init__(self, width=128, num_classes=1000, hidden=4096):
        super().__init__()
        self.features = nn.Sequential(
            conv_bn(3, width),
            conv_bn(width, width),
            conv_bn(width, 2 * width, stride=2),
            conv_bn(2 * width, 2 * width),
            conv_bn(2 * width, 4 * width, stride=2),
            conv_bn(4 * width, 4 * width),
            conv_bn(4 * width, 8 * width, stride=2),
            conv_bn(8 * width, 8 * width),
            nn.AdaptiveAvgPool2d(4),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(8 * width * 16, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(0.5),
            nn.Linear(hidden, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(0.5),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.head(self.features(x))


def setup():
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29500")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    return local_rank, rank, world_size


def main():
    parser = argparse.ArgumentParser(description="DDP static-graph training with fp16 AMP")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=64, help="per-GPU micro-batch size")
    parser.add_argument("--accum-steps", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--print-freq", type=int, default=1)
    args = parser.parse_args()

    local_rank, rank, world_size = setup()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234 + rank)

    model = ConvNet(args.width, args.num_classes, args.hidden)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    model = DDP(
        model,
        device_ids=[local_rank],
        static_graph=True,
        gradient_as_bucket_view=True,
        bucket_cap_mb=50,
        broadcast_buffers=False,
    )
    model.register_comm_hook(None, default_hooks.bf16_compress_hook)

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay, nesterov=True)
    scaler = torch.amp.GradScaler("cuda")
    criterion = nn.CrossEntropyLoss()

    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"world size {world_size} | params {n_params / 1e6:.1f}M | "
              f"global batch {args.batch_size * args.accum_steps * world_size}")

    model.train()
    for step in range(args.steps):
        t0 = time.time()
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(args.accum_steps):
            images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
            target = torch.randint(0, args.num_classes, (args.batch_size,), device=device)
            last = micro == args.accum_steps - 1
            # static_graph records the graph on its first backward, which must be a syncing one
            # (pytorch/pytorch#143580): the first step all-reduces every micro-batch
            ctx = contextlib.nullcontext() if last or step == 0 else model.no_sync()
            with ctx:
                with torch.autocast(device_type="cuda", dtype=torch.float16):
                    output = model(images)
                    loss = criterion(output, target) / args.accum_steps
                scaler.scale(loss).backward()
            total += loss.item()
        scaler.step(optimizer)
        scaler.update()
        torch.cuda.synchronize()
        if rank == 0 and step % args.print_freq == 0:
            print(f"step [{step + 1}/{args.steps}] loss {total:.4f} scale {scaler.get_scale():.0f} "
                  f"time {time.time() - t0:.3f}s")

    if rank == 0:
        print(f"max memory allocated: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
