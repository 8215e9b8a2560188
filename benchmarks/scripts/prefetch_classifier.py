#!/usr/bin/env python
"""Image classification the way older multi-GPU repositories train it.

``nn.DataParallel`` over the visible GPUs, a data prefetcher that copies the
next batch on a side stream while this one trains (NVIDIA apex's
``data_prefetcher``, timm's ``PrefetchLoader``), uint8 images normalised on the
device, channels-last, fp16 autocast with a GradScaler, gradient clipping, an
exponential moving average of the weights (``torch.optim.swa_utils``), a
one-cycle schedule and ``torch.backends.cudnn.benchmark``. Random images stand
in for a dataset, so it runs offline.

    python prefetch_classifier.py --batch-size 256 --image-size 128
"""

import argparse

import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=256)
parser.add_argument("--image-size", type=int, default=128)
parser.add_argument("--width", type=int, default=64)
parser.add_argument("--num-classes", type=int, default=1000)
parser.add_argument("--samples", type=int, default=4096)
parser.add_argument("--workers", type=int, default=2)
parser.add_argument("--lr", type=float, default=0.4)
args = parser.parse_args()

torch.backends.cudnn.benchmark = True
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255


class RandomImages(Dataset):
    def __len__(self):
        return args.samples

    def __getitem__(self, i):
        image = torch.randint(0, 256, (3, args.image_size, args.image_size), dtype=torch.uint8)
        return image, i % args.num_classes


class DataPrefetcher:
    def __init__(self, loader):
        self.loader = iter(loader)
        self.stream = torch.cuda.Stream()
        self.mean, self.std = MEAN.cuda(), STD.cuda()
        self.preload()

    def preload(self):
        try:
            self.next_input, self.next_target = next(self.loader)
        except StopIteration:
            self.next_input = self.next_target = None
            return
        with torch.cuda.stream(self.stream):
            self.next_input = self.next_input.cuda(non_blocking=True)
            self.next_target = self.next_target.cuda(non_blocking=True)
            self.next_input = self.next_input.float().sub_(self.mean).div_(self.std)

    def next(self):
        torch.cuda.current_stream().wait_stream(self.stream)
        inp, target = self.next_input, self.next_target
        if inp is not None:
            inp.record_stream(torch.cuda.current_stream())
            target.record_stream(torch.cuda.current_stream())
        self.preload()
        return inp, target


def conv_bn(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


w = args.width
model = nn.Sequential(
    conv_bn(3, w, 2), conv_bn(w, w), conv_bn(w, 2 * w, 2), conv_bn(2 * w, 2 * w), conv_bn(2 * w, 4 * w, 2),
    conv_bn(4 * w, 4 * w), conv_bn(4 * w, 8 * w, 2), conv_bn(8 * w, 8 * w),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8 * w, args.num_classes),
)
model = nn.DataParallel(model).cuda().to(memory_format=torch.channels_last)
ema = AveragedModel(model.module, multi_avg_fn=get_ema_multi_avg_fn(0.9998))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-5)
loader = DataLoader(RandomImages(), batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                    pin_memory=True, drop_last=True, persistent_workers=args.workers > 0)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(loader))
scaler = torch.amp.GradScaler("cuda")
criterion = nn.CrossEntropyLoss(label_smoothing=0.1).cuda()

for epoch in range(args.epochs):
    model.train()
    prefetcher = DataPrefetcher(loader)
    images, target = prefetcher.next()
    step = 0
    while images is not None:
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(images.contiguous(memory_format=torch.channels_last))
            loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        ema.update_parameters(model.module)
        if step % 10 == 0:
            print(f"epoch {epoch} step {step} loss {loss.item():.4f} "
                  f"max allocated {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
        images, target = prefetcher.next()
        step += 1
