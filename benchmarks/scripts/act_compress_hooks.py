# ResNet-18 image classifier trained with home-made activation compression, the habits of
# ActNN / "activation compressed training" research code: a torch.autograd.graph
# saved_tensors_hooks(pack, unpack) pair around the forward (and loss) that stores every
# saved floating-point activation above a size threshold as int8 with one per-tensor scale
# (pack returns a (q, scale, dtype) tuple, unpack dequantizes; small tensors and the
# parameters are kept as they are), a hand-written torchvision-style ResNet-18 (BasicBlock,
# in-place ReLU, `out += identity`), SGD with momentum + weight decay + a step LR schedule,
# a pinned-memory DataLoader over a synthetic dataset, and anomaly detection
# (torch.autograd.set_detect_anomaly) on for the first steps, the habit of hunting NaNs
# that quantization tends to cause. --no-compress trains the same model without the hooks.
import argparse
import contextlib
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def conv3x3(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResNet(nn.Module):
    def __init__(self, block, layers, num_classes=1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, block, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(block(self.inplanes, planes))
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
        return self.fc(x)


def resnet18(num_classes):
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes)


class Int8ActivationCompressor:
    """Per-tensor symmetric int8 quantization of saved activations (ActNN's 8-bit mode, minus
    the per-group scales and stochastic rounding)."""

    def __init__(self, min_numel=4096):
        self.min_numel = min_numel
        self.packed_bytes = 0
        self.raw_bytes = 0

    def pack(self, x):
        # parameters, integer tensors (indices, masks) and small tensors are kept as they are
        if (not x.is_floating_point()) or x.numel() < self.min_numel or (x.requires_grad and x.is_leaf):
            return x
        with torch.no_grad():
            scale = x.abs().amax().clamp_(min=1e-8) / 127.0
            q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
        self.raw_bytes += x.numel() * x.element_size()
        self.packed_bytes += q.numel()
        return (q, scale, x.dtype)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        q, scale, dtype = packed
        return q.to(dtype) * scale

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--num-classes", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--no-compress", action="store_true")
    parser.add_argument("--detect-anomaly-steps", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = args.device  # "cuda"
    model = resnet18(args.num_classes).to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"ResNet-18: {n_params:,} parameters")

    n_samples = args.batch_size * 4
    dataset = TensorDataset(torch.randn(n_samples, 3, args.image_size, args.image_size),
                            torch.randint(0, args.num_classes, (n_samples,)))
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        num_workers=0, pin_memory=torch.cuda.is_available())

    compressor = Int8ActivationCompressor()
    model.train()
    step = 0
    t0 = time.time()
    while step < args.steps:
        for images, labels in loader:
            if step >= args.steps:
                break
            torch.autograd.set_detect_anomaly(step < args.detect_anomaly_steps)
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            ctx = contextlib.nullcontext() if args.no_compress else compressor.hooks()
            with ctx:
                output = model(images)
                loss = criterion(output, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if not torch.isfinite(loss):
                raise RuntimeError(f"non-finite loss at step {step}")
            optimizer.step()
            scheduler.step()
            if step % 5 == 0:
                acc = (output.argmax(1) == labels).float().mean().item()
                ratio = compressor.packed_bytes / max(1, compressor.raw_bytes)
                print(f"step {step}: loss {loss.item():.4f} acc {acc:.3f} "
                      f"compressed/raw {ratio:.3f}")
            step += 1
    torch.autograd.set_detect_anomaly(False)
    if device == "cuda":
        torch.cuda.synchronize()
        print(f"peak allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB, "
              f"reserved {torch.cuda.max_memory_reserved() / 2**20:.1f} MiB")
    print(f"{args.steps} steps in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
