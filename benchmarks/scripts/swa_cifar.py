#!/usr/bin/env python
"""CIFAR-10 PreResNet trained with stochastic weight averaging (SWA) and a weight EMA.

Imitates the PyTorch docs' recipe for ``torch.optim.swa_utils``
(https://pytorch.org/docs/stable/optim.html#weight-averaging-swa-and-ema,
and the "PyTorch 1.6 now includes SWA" blog post) and timgaripov/swa
(``train.py``, ``models/preresnet.py``, ``utils.py``).

Habits copied:
- timgaripov/swa's PreResNet (pre-activation BasicBlock: BN -> ReLU -> conv,
  depth 6n+2, ``inplanes`` 16/32/64 scaled by ``--width``), the VGG16-BN of
  ``models/vgg.py`` selectable with ``--model vgg16bn``, He-normal init
  ``normal_(0, math.sqrt(2. / n))`` written out in ``__init__``.
- SGD momentum 0.9 with weight decay 3e-4 and ``CosineAnnealingLR`` stepped
  every iteration until ``swa_start``; then ``swa_model = AveragedModel(model)``
  (a deepcopy, on the GPU since the model is), ``swa_model.update_parameters(model)``
  every step and ``SWALR(optimizer, swa_lr=0.05, anneal_epochs=..., anneal_strategy="cos")``
  replacing the cosine schedule.
- ``torch.optim.swa_utils.update_bn(loader, swa_model, device=device)`` every
  ``--bn_every`` steps and at the end: a pass over (a few batches of) the
  training loader with the SWA model in train mode under ``no_grad``, the
  BatchNorm momenta set to None and running stats reset, then the SWA model
  evaluated under ``torch.no_grad()`` (``swa_model.eval()``) as in timgaripov's
  ``utils.eval``.
- a second average, the EMA variant the docs show:
  ``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))`` updated
  every step from the start (skipped if this torch lacks it).
- ``--channels_last``: model and inputs in ``torch.channels_last``.
- a ``DataLoader`` over a random 3x32x32 dataset (stand-in for CIFAR-10 after
  ``ToTensor``/``Normalize``), ``pin_memory=True``, ``non_blocking=True`` copies,
  ``F.cross_entropy``, running loss/accuracy sums as in ``utils.train_epoch``,
  batch 128.

    python swa_cifar.py --steps 10            # SWA from step 1, update_bn every 2 steps
    python swa_cifar.py --steps 200 --swa_start 150 --bn_every 10 --channels_last
"""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import CosineAnnealingLR
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn
from torch.utils.data import DataLoader, Dataset

try:
    from torch.optim.swa_utils import get_ema_multi_avg_fn
except ImportError:  # torch < 2.1
    get_ema_multi_avg_fn = None

parser = argparse.ArgumentParser(description="SGD/SWA training")
parser.add_argument("--model", type=str, default="preresnet20", choices=["preresnet20", "vgg16bn"])
parser.add_argument("--width", type=int, default=2, help="multiplier of PreResNet's 16/32/64 planes")
parser.add_argument("--batch_size", type=int, default=128)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--swa_start", type=int, default=1)
parser.add_argument("--swa_lr", type=float, default=0.05)
parser.add_argument("--lr_init", type=float, default=0.1)
parser.add_argument("--wd", type=float, default=3e-4)
parser.add_argument("--bn_every", type=int, default=2, help="update_bn + eval of the SWA model every N steps")
parser.add_argument("--bn_batches", type=int, default=2)
parser.add_argument("--ema", action=argparse.BooleanOptionalAction, default=True)
parser.add_argument("--channels_last", action="store_true")
args = parser.parse_args()

device = "cuda"


# ----------------------------------------------------------------------------- models (timgaripov/swa)
def conv3x3(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super(BasicBlock, self).__init__()
        self.bn1 = nn.BatchNorm2d(inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        residual = x

        out = self.bn1(x)
        out = self.relu(out)
        out = self.conv1(out)

        out = self.bn2(out)
        out = self.relu(out)
        out = self.conv2(out)

        if self.downsample is not None:
            residual = self.downsample(x)

        out += residual

        return out


class PreResNet(nn.Module):
    def __init__(self, num_classes=10, depth=20, width=1):
        super(PreResNet, self).__init__()
        assert (depth - 2) % 6 == 0, "depth should be 6n+2"
        n = (depth - 2) // 6
        block = BasicBlock
        w = width
        self.inplanes = 16 * w
        self.conv1 = nn.Conv2d(3, 16 * w, kernel_size=3, padding=1, bias=False)
        self.layer1 = self._make_layer(block, 16 * w, n)
        self.layer2 = self._make_layer(block, 32 * w, n, stride=2)
        self.layer3 = self._make_layer(block, 64 * w, n, stride=2)
        self.bn = nn.BatchNorm2d(64 * w * block.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.avgpool = nn.AvgPool2d(8)
        self.fc = nn.Linear(64 * w * block.expansion, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                n_ = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
                m.weight.data.normal_(0, math.sqrt(2. / n_))
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.data.fill_(1)
                m.bias.data.zero_()

    def _make_layer(self, block, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * block.expansion, kernel_size=1, stride=stride, bias=False),
            )
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(block(self.inplanes, planes))
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.conv1(x)

        x = self.layer1(x)  # 32x32
        x = self.layer2(x)  # 16x16
        x = self.layer3(x)  # 8x8
        x = self.bn(x)
        x = self.relu(x)

        x = self.avgpool(x)
        x = x.view(x.size(0), -1)
        x = self.fc(x)

        return x


def make_layers(cfg, batch_norm=False):
    layers = list()
    in_channels = 3
    for v in cfg:
        if v == "M":
            layers += [nn.MaxPool2d(kernel_size=2, stride=2)]
        else:
            conv2d = nn.Conv2d(in_channels, v, kernel_size=3, padding=1)
            if batch_norm:
                layers += [conv2d, nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
            else:
                layers += [conv2d, nn.ReLU(inplace=True)]
            in_channels = v
    return nn.Sequential(*layers)


class VGG(nn.Module):
    def __init__(self, num_classes=10, depth=16, batch_norm=False):
        super(VGG, self).__init__()
        cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
        self.features = make_layers(cfg, batch_norm)
        self.classifier = nn.Sequential(
            nn.Dropout(),
            nn.Linear(512, 512),
            nn.ReLU(True),
            nn.Dropout(),
            nn.Linear(512, 512),
            nn.ReLU(True),
            nn.Linear(512, num_classes),
        )

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                n = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
                m.weight.data.normal_(0, math.sqrt(2. / n))
                m.bias.data.zero_()

    def forward(self, x):
        x = self.features(x)
        x = x.view(x.size(0), -1)
        x = self.classifier(x)
        return x


# ----------------------------------------------------------------------------- data
class RandomCIFAR(Dataset):
    """Stand-in for torchvision.datasets.CIFAR10 after ToTensor + Normalize."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def eval_model(loader, model, criterion, n_batches):
    loss_sum = 0.0
    correct = 0
    n = 0
    model.eval()
    with torch.no_grad():
        for i, (input, target) in enumerate(loader):
            if i == n_batches:
                break
            input = input.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            if args.channels_last:
                input = input.contiguous(memory_format=torch.channels_last)
            output = model(input)
            loss = criterion(output, target)
            loss_sum += loss.item() * input.size(0)
            pred = output.data.argmax(1, keepdim=True)
            correct += pred.eq(target.data.view_as(pred)).sum().item()
            n += input.size(0)
    return {"loss": loss_sum / n, "accuracy": correct / n * 100.0}


class FirstBatches:
    """A few batches of the train loader for update_bn (a full epoch in the recipe)."""

    def __init__(self, loader, n):
        self.loader, self.n = loader, n

    def __iter__(self):
        for i, batch in enumerate(self.loader):
            if i == self.n:
                return
            yield batch


def main():
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(1)

    train_set = RandomCIFAR(args.batch_size * 8)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=0, pin_memory=True,
                        drop_last=True)
    test_loader = DataLoader(RandomCIFAR(args.batch_size * 2), batch_size=args.batch_size, shuffle=False,
                             num_workers=0, pin_memory=True)

    if args.model == "preresnet20":
        model = PreResNet(num_classes=10, depth=20, width=args.width)
    else:
        model = VGG(num_classes=10, depth=16, batch_norm=True)
    model.to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    print("params:", sum(p.numel() for p in model.parameters()))

    criterion = F.cross_entropy
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr_init, momentum=0.9, weight_decay=args.wd)
    scheduler = CosineAnnealingLR(optimizer, T_max=max(args.swa_start, 1))
    swa_model = None
    swa_scheduler = SWALR(optimizer, swa_lr=args.swa_lr, anneal_epochs=2, anneal_strategy="cos")
    ema_model = None
    if args.ema and get_ema_multi_avg_fn is not None:
        ema_model = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))

    step = 0
    loss_sum, correct, seen = 0.0, 0, 0
    t0 = time.time()
    while step < args.steps:
        for input, target in loader:
            if step >= args.steps:
                break
            model.train()
            input = input.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            if args.channels_last:
                input = input.contiguous(memory_format=torch.channels_last)

            output = model(input)
            loss = criterion(output, target)

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            loss_sum += loss.item() * input.size(0)
            pred = output.data.argmax(1, keepdim=True)
            correct += pred.eq(target.data.view_as(pred)).sum().item()
            seen += input.size(0)

            if ema_model is not None:
                ema_model.update_parameters(model)

            if step >= args.swa_start:
                if swa_model is None:
                    swa_model = AveragedModel(model)
                swa_model.update_parameters(model)
                swa_scheduler.step()
            else:
                scheduler.step()

            if swa_model is not None and (step + 1) % args.bn_every == 0:
                update_bn(FirstBatches(loader, args.bn_batches), swa_model, device=device)
                swa_res = eval_model(test_loader, swa_model, criterion, 1)
                print(f"  step {step} swa eval: loss {swa_res['loss']:.4f} acc {swa_res['accuracy']:.2f}")

            print(f"step {step} | lr {optimizer.param_groups[0]['lr']:.4f} | loss {loss.item():.4f} | "
                  f"train acc {correct / seen * 100:.2f} | {time.time() - t0:.2f}s")
            step += 1

    if swa_model is not None:
        update_bn(FirstBatches(loader, args.bn_batches), swa_model, device=device)
        print("swa:", eval_model(test_loader, swa_model, criterion, 2))
    if ema_model is not None:
        print("ema:", eval_model(test_loader, ema_model, criterion, 2))
    print("sgd:", eval_model(test_loader, model, criterion, 2))


if __name__ == "__main__":
    main()
