#!/usr/bin/env python
"""Schedule-free AdamW on a small CIFAR-style ResNet with BatchNorm, in the style of
facebookresearch/schedule_free: ``AdamWScheduleFree`` as in
schedulefree/adamw_schedulefree.py (a ``torch.optim.Optimizer`` keeping ``z`` and
``exp_avg_sq`` per parameter, the parameters holding ``y`` in train mode and ``x`` in eval
mode, ``optimizer.train()`` / ``optimizer.eval()`` swapping them in place with ``lerp_``,
warmup inside the optimizer, no LR scheduler), and the README's advice for BatchNorm:
before evaluating, recompute the running statistics at ``x`` with a few training batches
under ``model.train()`` and ``torch.no_grad()``. Random images stand in for CIFAR-10, so
it runs offline.

    python schedulefree_adamw.py
    python schedulefree_adamw.py --width 64 --blocks 3 --batch-size 256 --steps 2000 --eval-every 200
"""
import argparse
import itertools
import math
import time
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class AdamWScheduleFree(torch.optim.Optimizer):
    r"""
    Schedule-Free AdamW
    As the name suggests, no scheduler is needed with this optimizer.
    To add warmup, rather than using a learning rate schedule you can just
    set the warmup_steps parameter.

    This optimizer requires that .train() and .eval() be called before the
    beginning of training and evaluation respectively. The optimizer should
    also be placed in eval mode when saving checkpoints.
    """
    def __init__(self,
                 params,
                 lr: float = 0.0025,
                 betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8,
                 weight_decay: float = 0,
                 warmup_steps: int = 0,
                 r: float = 0.0,
                 weight_lr_power: float = 2.0,
                 foreach: Optional[bool] = hasattr(torch, "_foreach_mul_")
                 ):

        defaults = dict(lr=lr,
                        betas=betas,
                        eps=eps,
                        r=r,
                        k=0,
                        warmup_steps=warmup_steps,
                        train_mode=False,
                        weight_sum=0.0,
                        lr_max=-1.0,
                        scheduled_lr=0.0,
                        weight_lr_power=weight_lr_power,
                        weight_decay=weight_decay,
                        foreach=foreach)
        super().__init__(params, defaults)

    @torch.no_grad()
    def eval(self):
        for group in self.param_groups:
            train_mode = group['train_mode']
            beta1, _ = group['betas']
            if train_mode:
                active = [p for p in group['params'] if 'z' in self.state[p]]
                if group['foreach'] and active:
                    # Set p to x
                    torch._foreach_lerp_(active, [self.state[p]['z'] for p in active], weight=1 - 1 / beta1)
                else:
                    for p in active:
                        # Set p to x
                        p.data.lerp_(end=self.state[p]['z'].to(p.data.device), weight=1 - 1 / beta1)
                group['train_mode'] = False

    @torch.no_grad()
    def train(self):
        for group in self.param_groups:
            train_mode = group['train_mode']
            beta1, _ = group['betas']
            if not train_mode:
                active = [p for p in group['params'] if 'z' in self.state[p]]
                if group['foreach'] and active:
                    # Set p to y
                    torch._foreach_lerp_(active, [self.state[p]['z'] for p in active], weight=1 - beta1)
                else:
                    for p in active:
                        # Set p to y
                        p.data.lerp_(end=self.state[p]['z'].to(p.data.device), weight=1 - beta1)
                group['train_mode'] = True

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Performs a single optimization step.

        Arguments:
            closure (callable, optional): A closure that reevaluates the model
                and returns the loss.
        """
        if not self.param_groups[0]['train_mode']:
            raise Exception("Optimizer was not in train mode when step is called. "
                            "Please insert .train() and .eval() calls on the "
                            "optimizer. See documentation for details.")

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            eps = group['eps']
            beta1, beta2 = group['betas']
            decay = group['weight_decay']
            k = group['k']
            r = group['r']
            warmup_steps = group['warmup_steps']
            weight_lr_power = group['weight_lr_power']

            if k < warmup_steps:
                sched = (k + 1) / warmup_steps
            else:
                sched = 1.0

            bias_correction2 = 1 - beta2 ** (k + 1)
            lr = group['lr'] * sched
            group['scheduled_lr'] = lr  # For logging purposes

            lr_max = group['lr_max'] = max(lr, group['lr_max'])

            weight = ((k + 1) ** r) * (lr_max ** weight_lr_power)
            weight_sum = group['weight_sum'] = group['weight_sum'] + weight

            try:
                ckp1 = weight / weight_sum
            except ZeroDivisionError:
                ckp1 = 0

            adj_lr = lr * (1 - beta1)

            active_p = [p for p in group['params'] if p.grad is not None]

            for p in active_p:
                if 'z' not in self.state[p]:
                    self.state[p]['z'] = torch.clone(p, memory_format=torch.preserve_format)
                    self.state[p]['exp_avg_sq'] = torch.zeros_like(p, memory_format=torch.preserve_format)

            if group['foreach'] and len(active_p) > 0:
                y, grad, exp_avg_sq, z = zip(*[(p,
                                                p.grad,
                                                self.state[p]['exp_avg_sq'],
                                                self.state[p]['z'])
                                               for p in active_p])

                # Decay the first and second moment running average coefficient
                torch._foreach_mul_(exp_avg_sq, beta2)
                torch._foreach_addcmul_(exp_avg_sq, grad, grad, value=1 - beta2)
                denom = torch._foreach_div(exp_avg_sq, bias_correction2)
                torch._foreach_sqrt_(denom)
                torch._foreach_add_(denom, eps)

                # Normalize grad in-place for memory efficiency
                torch._foreach_div_(grad, denom)

                # Weight decay calculated at y
                if decay != 0:
                    torch._foreach_add_(grad, y, alpha=decay)

                # These operations update y in-place,
                # without computing x explicitly.
                torch._foreach_lerp_(y, z, weight=ckp1)
                torch._foreach_add_(y, grad, alpha=adj_lr * (beta1 * (1 - ckp1) - 1))

                # z step
                torch._foreach_sub_(z, grad, alpha=lr)
            else:
                for p in active_p:
                    y = p.data  # Notation to match theory
                    grad = p.grad.data

                    state = self.state[p]

                    z = state['z']
                    exp_avg_sq = state['exp_avg_sq']

                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                    denom = exp_avg_sq.div(bias_correction2).sqrt_().add_(eps)

                    # Reuse grad buffer for memory efficiency
                    grad_normalized = grad.div_(denom)

                    # Weight decay calculated at y
                    if decay != 0:
                        grad_normalized.add_(y, alpha=decay)

                    # These operations update y in-place,
                    # without computing x explicitly.
                    y.lerp_(end=z, weight=ckp1)
                    y.add_(grad_normalized, alpha=adj_lr * (beta1 * (1 - ckp1) - 1))

                    # z step
                    z.sub_(grad_normalized, alpha=lr)

            group['k'] = k + 1
        return loss


# --- model: a small pre-activation-free CIFAR ResNet --------------------------------------
class BasicBlock(nn.Module):
    def __init__(self, in_planes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False),
                                          nn.BatchNorm2d(planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, width=32, blocks=2, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        layers, in_planes = [], width
        for i, planes in enumerate([width, 2 * width, 4 * width, 8 * width]):
            for j in range(blocks):
                stride = 2 if (i > 0 and j == 0) else 1
                layers.append(BasicBlock(in_planes, planes, stride))
                in_planes = planes
        self.layers = nn.Sequential(*layers)
        self.linear = nn.Linear(in_planes, num_classes)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


class RandomCIFAR(Dataset):
    def __init__(self, n, image_size, num_classes):
        self.n, self.image_size, self.num_classes = n, image_size, num_classes

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(3, self.image_size, self.image_size, generator=g), i % self.num_classes


def main():
    parser = argparse.ArgumentParser(description='Schedule-Free AdamW, CIFAR-style ResNet (random data)')
    parser.add_argument('--batch-size', type=int, default=32)
    parser.add_argument('--test-batch-size', type=int, default=64)
    parser.add_argument('--image-size', type=int, default=32)
    parser.add_argument('--width', type=int, default=32)
    parser.add_argument('--blocks', type=int, default=1, help='blocks per stage')
    parser.add_argument('--num-classes', type=int, default=10)
    parser.add_argument('--steps', type=int, default=10)
    parser.add_argument('--eval-every', type=int, default=4)
    parser.add_argument('--bn-batches', type=int, default=2,
                        help='training batches to recompute BatchNorm statistics at x before eval')
    parser.add_argument('--eval-batches', type=int, default=2)
    parser.add_argument('--lr', type=float, default=0.0025)
    parser.add_argument('--beta1', type=float, default=0.9)
    parser.add_argument('--weight-decay', type=float, default=5e-4)
    parser.add_argument('--warmup-steps', type=int, default=5)
    parser.add_argument('--no-foreach', action='store_true')
    parser.add_argument('--bf16', action='store_true', help='bf16 autocast')
    parser.add_argument('--workers', type=int, default=0)
    parser.add_argument('--log-interval', type=int, default=2)
    parser.add_argument('--seed', type=int, default=1)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    if device.type == 'cuda':
        torch.backends.cudnn.benchmark = True

    train_set = RandomCIFAR(args.batch_size * args.steps, args.image_size, args.num_classes)
    test_set = RandomCIFAR(args.test_batch_size * args.eval_batches, args.image_size, args.num_classes)
    kwargs = {'num_workers': args.workers, 'pin_memory': device.type == 'cuda'}
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True, **kwargs)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, shuffle=False, **kwargs)

    model = ResNet(args.width, args.blocks, args.num_classes).to(device)
    optimizer = AdamWScheduleFree(model.parameters(), lr=args.lr, betas=(args.beta1, 0.999),
                                  weight_decay=args.weight_decay, warmup_steps=args.warmup_steps,
                                  foreach=not args.no_foreach)
    print(f"params: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")

    def evaluate(step):
        # schedule_free README: BatchNorm's running statistics were gathered at y; recompute them at x.
        model.train()
        optimizer.eval()
        with torch.no_grad():
            for data, _ in itertools.islice(train_loader, args.bn_batches):
                model(data.to(device, non_blocking=True))
        model.eval()
        test_loss, correct, seen = 0.0, 0, 0
        with torch.no_grad():
            for data, target in test_loader:
                data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                    output = model(data)
                test_loss += F.cross_entropy(output.float(), target, reduction='sum').item()
                pred = output.argmax(dim=1, keepdim=True)
                correct += pred.eq(target.view_as(pred)).sum().item()
                seen += data.size(0)
        print(f"step {step}: test loss {test_loss / seen:.4f}, accuracy {correct}/{seen} "
              f"({100. * correct / seen:.0f}%)")

    step = 0
    t0 = time.time()
    while step < args.steps:
        for data, target in train_loader:
            model.train()
            optimizer.train()
            data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                output = model(data)
                loss = F.cross_entropy(output, target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % args.log_interval == 0:
                lr = optimizer.param_groups[0]['scheduled_lr']
                print(f"step {step} loss {loss.item():.4f} lr {lr:.2e} ({time.time() - t0:.1f}s)")
            if step % args.eval_every == 0:
                evaluate(step)
            if step >= args.steps:
                break
    evaluate(step)
    optimizer.eval()  # the weights to keep are x


if __name__ == '__main__':
    main()
