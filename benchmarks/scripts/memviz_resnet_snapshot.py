"""PyTorch blog "Understanding GPU Memory 1: Visualizing All Allocations over Time" habit on a hand-written ResNet-50 (SGD+momentum, optional fp16 autocast + GradScaler): _record_memory_history(max_entries=100000) in the loop, _dump_snapshot(f"{host}_{timestamp}.pickle") after a few steps, memory_summary() / memory_stats()["allocated_bytes.all.peak"] every N steps, gc.collect() + empty_cache() + reset_peak_memory_stats() every step, synchronize()-timed steps and mem_get_info().

Kaggle/forum "why is my memory growing" debugging style: the training loop keeps
calling the allocator's introspection APIs while it trains, and writes a snapshot that
can be dragged into https://pytorch.org/memory_viz.

    python memviz_resnet_snapshot.py --batch-size 64 --snapshot-step 3
"""
import argparse
import gc
import logging
import os
import socket
import time
from datetime import datetime

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

logging.basicConfig(
    format="%(levelname)s:%(asctime)s %(message)s",
    level=logging.INFO,
    datefmt="%Y-%m-%d %H:%M:%S",
)
logger: logging.Logger = logging.getLogger(__name__)
logger.setLevel(level=logging.INFO)

TIME_FORMAT_STR: str = "%b_%d_%H_%M_%S"

# Keep a max of 100,000 alloc/free events in the recorded history
# leading up to the snapshot.
MAX_NUM_OF_MEM_EVENTS_PER_SNAPSHOT: int = 100000


# --------------------------------------------------------------------------- #
# memory snapshot helpers (copied from the blog post)
# --------------------------------------------------------------------------- #
def start_record_memory_history(max_entries=MAX_NUM_OF_MEM_EVENTS_PER_SNAPSHOT) -> None:
    if not torch.cuda.is_available():
        logger.info("CUDA unavailable. Not recording memory history")
        return

    logger.info("Starting snapshot record_memory_history")
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def stop_record_memory_history() -> None:
    if not torch.cuda.is_available():
        logger.info("CUDA unavailable. Not recording memory history")
        return

    logger.info("Stopping snapshot record_memory_history")
    torch.cuda.memory._record_memory_history(enabled=None)


def export_memory_snapshot(out_dir=".") -> None:
    if not torch.cuda.is_available():
        logger.info("CUDA unavailable. Not exporting memory snapshot")
        return

    # Prefix for file names.
    host_name = socket.gethostname()
    timestamp = datetime.now().strftime(TIME_FORMAT_STR)
    file_prefix = os.path.join(out_dir, f"{host_name}_{timestamp}")

    try:
        logger.info(f"Saving snapshot to local file: {file_prefix}.pickle")
        torch.cuda.memory._dump_snapshot(f"{file_prefix}.pickle")
    except Exception as e:
        logger.error(f"Failed to capture memory snapshot {e}")
        return


def gpu_mem_report(tag=""):
    free, total = torch.cuda.mem_get_info()
    alloc = torch.cuda.memory_allocated() / 2**30
    reserved = torch.cuda.memory_reserved() / 2**30
    peak = torch.cuda.memory_stats()["allocated_bytes.all.peak"] / 2**30
    logger.info(
        f"[{tag}] allocated {alloc:.2f} GiB | reserved {reserved:.2f} GiB | "
        f"peak {peak:.2f} GiB | free {free / 2**30:.2f} / {total / 2**30:.2f} GiB"
    )


# --------------------------------------------------------------------------- #
# ResNet-50 (torchvision.models.resnet layout, written out so torchvision is not needed)
# --------------------------------------------------------------------------- #
def conv3x3(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x

        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)

        out = self.conv2(out)
        out = self.bn2(out)
        out = self.relu(out)

        out = self.conv3(out)
        out = self.bn3(out)

        if self.downsample is not None:
            identity = self.downsample(x)

        out += identity
        out = self.relu(out)
        return out


class ResNet(nn.Module):
    def __init__(self, layers=(3, 4, 6, 3), num_classes=1000, width=64):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * Bottleneck.expansion, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
        # zero-init the last BN in each residual branch
        for m in self.modules():
            if isinstance(m, Bottleneck):
                nn.init.constant_(m.bn3.weight, 0)

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * Bottleneck.expansion, stride),
                nn.BatchNorm2d(planes * Bottleneck.expansion),
            )
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        for _ in range(1, blocks):
            layers.append(Bottleneck(self.inplanes, planes))
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)

        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)

        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        return x


# --------------------------------------------------------------------------- #
# fake ImageNet
# --------------------------------------------------------------------------- #
class RandomImageDataset(Dataset):
    def __init__(self, length, image_size, num_classes, seed=0):
        self.length = length
        self.image_size = image_size
        self.num_classes = num_classes
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return self.length

    def __getitem__(self, idx):
        img = self.rng.standard_normal((3, self.image_size, self.image_size), dtype=np.float32)
        label = int(self.rng.integers(0, self.num_classes))
        return torch.from_numpy(img), label


def get_args():
    parser = argparse.ArgumentParser(description="ResNet-50 training with memory snapshots")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--width", type=int, default=64, help="base width of the ResNet")
    parser.add_argument("--layers", type=int, nargs=4, default=[3, 4, 6, 3])
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--amp", action="store_true", help="fp16 autocast + GradScaler")
    parser.add_argument("--max-entries", type=int, default=MAX_NUM_OF_MEM_EVENTS_PER_SNAPSHOT)
    parser.add_argument("--snapshot-step", type=int, default=3, help="dump the snapshot after this step")
    parser.add_argument("--snapshot-dir", type=str, default=".")
    parser.add_argument("--print-freq", type=int, default=5)
    return parser.parse_args()


def main():
    args = get_args()
    device = "cuda"
    torch.backends.cudnn.benchmark = True

    model = ResNet(layers=args.layers, num_classes=args.num_classes, width=args.width).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(f"model has {n_params / 1e6:.1f}M parameters")

    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    dataset = RandomImageDataset(args.steps * args.batch_size, args.image_size, args.num_classes)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        pin_memory=True,
        drop_last=True,
    )

    gpu_mem_report("after model init")

    # Start recording memory snapshot history
    start_record_memory_history(args.max_entries)
    snapshot_done = False

    model.train()
    step_times = []
    for step, (images, target) in enumerate(loader):
        if step >= args.steps:
            break

        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

        torch.cuda.synchronize()
        t0 = time.perf_counter()

        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)

        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=args.amp):
            output = model(images)
            loss = criterion(output, target)

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        step_times.append(dt)

        peak = torch.cuda.memory_stats()["allocated_bytes.all.peak"]
        logger.info(
            f"step {step:4d} | loss {loss.item():.4f} | {dt * 1000:.1f} ms | "
            f"{args.batch_size / dt:.1f} img/s | peak allocated {peak / 2**30:.2f} GiB"
        )

        if step % args.print_freq == 0:
            print(torch.cuda.memory_summary(device=device, abbreviated=True))
            gpu_mem_report(f"step {step}")

        if not snapshot_done and step + 1 >= args.snapshot_step:
            # Create the memory snapshot file
            export_memory_snapshot(args.snapshot_dir)
            # Stop recording memory snapshot history
            stop_record_memory_history()
            snapshot_done = True

    if not snapshot_done:
        export_memory_snapshot(args.snapshot_dir)
        stop_record_memory_history()

    if step_times:
        steady = step_times[1:] or step_times
        logger.info(f"mean step time {1000 * sum(steady) / len(steady):.1f} ms")
    free, total = torch.cuda.mem_get_info()
    logger.info(f"done: {free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
