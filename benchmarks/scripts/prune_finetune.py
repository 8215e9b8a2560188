# Iterative magnitude pruning + fine-tuning of a ResNet-18, in the style of the PyTorch pruning tutorial
# (tutorials/intermediate_source/pruning_tutorial.py: torch.nn.utils.prune.global_unstructured with
# L1Unstructured over (module, "weight") pairs, ln_structured on one layer, prune.remove at the end),
# fine-tuned between pruning rounds with SGD (momentum, nesterov) and a cosine LR schedule.
"""
Every conv and linear weight becomes `weight_orig` (a parameter) + `weight_mask` (a buffer), and a
forward pre-hook recomputes `weight = weight_orig * weight_mask` before each forward. Every
`--prune-every` optimizer steps the global L1 pruning is applied again (the amount compounds: the
tutorial's PruningContainer prunes `amount` of what is still unpruned). At the end every
reparametrisation is made permanent with `prune.remove`.

Data is random: CIFAR/ImageNet-shaped fake batches so the script runs anywhere.
torchvision's resnet18 is used when torchvision imports, else an equivalent local ResNet-18.
"""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.prune as prune

try:
    import torchvision
    HAVE_TV = True
except Exception:  # torchvision missing or broken for this torch build
    HAVE_TV = False


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """torchvision.models.resnet18's layout, for machines without torchvision."""

    def __init__(self, num_classes=1000, width=64):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(width, 2)
        self.layer2 = self._make_layer(width * 2, 2, stride=2)
        self.layer3 = self._make_layer(width * 4, 2, stride=2)
        self.layer4 = self._make_layer(width * 8, 2, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride, bias=False),
                                       nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def sparsity(parameters_to_prune):
    zeros = sum(float(torch.sum(getattr(m, n) == 0)) for m, n in parameters_to_prune)
    total = sum(float(getattr(m, n).nelement()) for m, n in parameters_to_prune)
    return 100.0 * zeros / total


def get_args():
    p = argparse.ArgumentParser(description="iterative L1 pruning + fine-tuning (pruning tutorial style)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--width", type=int, default=64, help="width of the local ResNet-18 (torchvision's is 64)")
    p.add_argument("--no-torchvision", action="store_true", help="use the local ResNet-18 even if torchvision imports")
    p.add_argument("--prune-rounds", type=int, default=3)
    p.add_argument("--prune-every", type=int, default=2, help="optimizer steps of fine-tuning per pruning round")
    p.add_argument("--amount", type=float, default=0.2, help="fraction pruned per round (global L1)")
    p.add_argument("--structured-amount", type=float, default=0.3, help="ln_structured amount on layer4's last conv")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0: all)")
    return p.parse_args()


def main():
    args = get_args()
    torch.manual_seed(0)
    device = torch.device(args.device)

    if HAVE_TV and not args.no_torchvision:
        model = torchvision.models.resnet18(num_classes=args.num_classes)
    else:
        model = ResNet18(num_classes=args.num_classes, width=args.width)
    model = model.to(device)
    criterion = nn.CrossEntropyLoss()

    # The tutorial's list of (module, name) pairs: every conv and linear weight.
    parameters_to_prune = tuple(
        (module, "weight") for module in model.modules() if isinstance(module, (nn.Conv2d, nn.Linear))
    )
    print(f"pruning {len(parameters_to_prune)} weights, "
          f"{sum(m.weight.numel() for m, _ in parameters_to_prune) / 1e6:.2f}M elements")

    # Structured pruning of one layer first: drop 30% of layer4's last conv's output channels by L2 norm.
    last_conv = model.layer4[-1].conv2
    prune.ln_structured(last_conv, name="weight", amount=args.structured_amount, n=2, dim=0)
    print("after ln_structured:", [n for n, _ in last_conv.named_parameters()],
          [n for n, _ in last_conv.named_buffers()])

    # Optimizer over model.parameters() *after* ln_structured: last_conv's parameter is now weight_orig
    # (the same Parameter object), the others are renamed on the first global prune below.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay, nesterov=True)
    total_steps = args.prune_rounds * args.prune_every
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total_steps, 1))

    step = 0
    t0 = time.time()
    for rnd in range(args.prune_rounds):
        # Prune: global L1 over all listed weights. Compounds with the previous rounds' masks.
        prune.global_unstructured(parameters_to_prune, pruning_method=prune.L1Unstructured, amount=args.amount)
        print(f"round {rnd}: global sparsity {sparsity(parameters_to_prune):.1f}%  "
              f"fc.weight_mask {tuple(model.fc.weight_mask.shape)}  "
              f"hooks on conv1: {len(model.conv1._forward_pre_hooks)}")

        # Fine-tune.
        model.train()
        for _ in range(args.prune_every):
            images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
            target = torch.randint(0, args.num_classes, (args.batch_size,), device=device)
            output = model(images)
            loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            print(f"round {rnd} step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.5f}")
            if args.max_steps and step >= args.max_steps:
                break
        if args.max_steps and step >= args.max_steps:
            break

    # Quick eval on one batch with the masks still applied.
    model.eval()
    with torch.no_grad():
        images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
        acc = (model(images).argmax(1) == 0).float().mean().item()
    print(f"eval (random data) acc {acc:.3f}")

    # Make the pruning permanent: weight_orig * weight_mask -> weight, drop mask, hook and weight_orig.
    for module, name in parameters_to_prune:
        if prune.is_pruned(module):
            prune.remove(module, name)
    print("after prune.remove:", [n for n, _ in last_conv.named_parameters()],
          [n for n, _ in last_conv.named_buffers()], f"sparsity {sparsity(parameters_to_prune):.1f}%")
    print(f"trained {step} steps in {time.time() - t0:.1f}s")
    if device.type == "cuda":
        print("max memory allocated: %.1f MiB" % (torch.cuda.max_memory_allocated() / 2**20))


if __name__ == "__main__":
    main()
