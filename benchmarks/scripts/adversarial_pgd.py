# PGD adversarial training of a PreAct ResNet-18 on CIFAR-size data, in the style of
# locuslab/fast_adversarial (CIFAR10/train_pgd.py, preact_resnet.py, utils.py) after Madry et al.:
# per batch a random start delta in [-eps, eps], `--attack-iters` steps of signed-gradient
# ascent on delta through the model in train mode (the inner loop's backward also fills the
# parameters' .grad, which opt.zero_grad() clears before the real step, as in the repo), then one
# training step on X + delta under fp16 autocast with a GradScaler (torch.amp in place of apex
# amp) and a CyclicLR stepped every batch. `--attack-grad autograd` takes delta's gradient with
# torch.autograd.grad instead (MadryLab robustness's habit); `--attack-eval` attacks in eval mode.
# Random images stand in for CIFAR-10, so it runs offline.
#
#     python adversarial_pgd.py --batch-size 128 --width 64 --attack-iters 7
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

cifar10_mean = (0.4914, 0.4822, 0.4465)
cifar10_std = (0.2471, 0.2435, 0.2616)


class PreActBlock(nn.Module):
    '''Pre-activation version of the BasicBlock.'''
    expansion = 1

    def __init__(self, in_planes, planes, stride=1):
        super(PreActBlock, self).__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)

        if stride != 1 or in_planes != self.expansion * planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, self.expansion * planes, kernel_size=1, stride=stride, bias=False)
            )

    def forward(self, x):
        out = F.relu(self.bn1(x))
        shortcut = self.shortcut(out) if hasattr(self, 'shortcut') else x
        out = self.conv1(out)
        out = self.conv2(F.relu(self.bn2(out)))
        out += shortcut
        return out


class PreActResNet(nn.Module):
    def __init__(self, block, num_blocks, num_classes=10, width=64):
        super(PreActResNet, self).__init__()
        self.in_planes = width

        self.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
        self.layer1 = self._make_layer(block, width, num_blocks[0], stride=1)
        self.layer2 = self._make_layer(block, 2 * width, num_blocks[1], stride=2)
        self.layer3 = self._make_layer(block, 4 * width, num_blocks[2], stride=2)
        self.layer4 = self._make_layer(block, 8 * width, num_blocks[3], stride=2)
        self.bn = nn.BatchNorm2d(8 * width * block.expansion)
        self.linear = nn.Linear(8 * width * block.expansion, num_classes)

    def _make_layer(self, block, planes, num_blocks, stride):
        strides = [stride] + [1] * (num_blocks - 1)
        layers = []
        for stride in strides:
            layers.append(block(self.in_planes, planes, stride))
            self.in_planes = planes * block.expansion
        return nn.Sequential(*layers)

    def forward(self, x):
        out = self.conv1(x)
        out = self.layer1(out)
        out = self.layer2(out)
        out = self.layer3(out)
        out = self.layer4(out)
        out = F.relu(self.bn(out))
        out = F.adaptive_avg_pool2d(out, 1)
        out = out.view(out.size(0), -1)
        out = self.linear(out)
        return out


def PreActResNet18(width=64):
    return PreActResNet(PreActBlock, [2, 2, 2, 2], width=width)


def clamp(X, lower_limit, upper_limit):
    return torch.max(torch.min(X, upper_limit), lower_limit)


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument('--batch-size', default=128, type=int)
    parser.add_argument('--width', default=16, type=int, help='channels of the first stage (64 in the repo)')
    parser.add_argument('--img-size', default=32, type=int)
    parser.add_argument('--epochs', default=15, type=int)
    parser.add_argument('--batches', default=50, type=int, help='batches per epoch (random data)')
    parser.add_argument('--lr-schedule', default='cyclic', choices=['cyclic', 'onecycle'])
    parser.add_argument('--lr-min', default=0., type=float)
    parser.add_argument('--lr-max', default=0.2, type=float)
    parser.add_argument('--weight-decay', default=5e-4, type=float)
    parser.add_argument('--momentum', default=0.9, type=float)
    parser.add_argument('--epsilon', default=8, type=int)
    parser.add_argument('--alpha', default=2, type=int, help='Step size')
    parser.add_argument('--attack-iters', default=3, type=int, help='Attack iterations')
    parser.add_argument('--attack-grad', default='backward', choices=['backward', 'autograd'])
    parser.add_argument('--attack-eval', action='store_true', help='model.eval() while attacking')
    parser.add_argument('--delta-init', default='random', choices=['zero', 'random'])
    parser.add_argument('--no-amp', action='store_true')
    parser.add_argument('--max-steps', default=None, type=int)
    parser.add_argument('--device', default=None)
    parser.add_argument('--seed', default=0, type=int)
    return parser.parse_args()


def main():
    args = get_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    use_amp = not args.no_amp and device.startswith("cuda")

    mu = torch.tensor(cifar10_mean).view(3, 1, 1).to(device)
    std = torch.tensor(cifar10_std).view(3, 1, 1).to(device)
    upper_limit = ((1 - mu) / std)
    lower_limit = ((0 - mu) / std)
    epsilon = (args.epsilon / 255.) / std
    alpha = (args.alpha / 255.) / std

    model = PreActResNet18(args.width).to(device)
    model.train()

    opt = torch.optim.SGD(model.parameters(), lr=args.lr_max, momentum=args.momentum, weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
    criterion = nn.CrossEntropyLoss()

    lr_steps = args.epochs * args.batches
    if args.lr_schedule == 'cyclic':
        scheduler = torch.optim.lr_scheduler.CyclicLR(opt, base_lr=args.lr_min, max_lr=args.lr_max,
                                                      step_size_up=lr_steps / 2, step_size_down=lr_steps / 2)
    else:
        scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr_max, total_steps=lr_steps)

    step = 0
    start_train_time = time.time()
    for epoch in range(args.epochs):
        train_loss = 0
        train_acc = 0
        train_n = 0
        for i in range(args.batches):
            X = ((torch.rand(args.batch_size, 3, args.img_size, args.img_size) - torch.tensor(cifar10_mean).view(3, 1, 1))
                 / torch.tensor(cifar10_std).view(3, 1, 1))
            y = torch.randint(0, 10, (args.batch_size,))
            X, y = X.to(device), y.to(device)

            delta = torch.zeros_like(X).to(device)
            if args.delta_init == 'random':
                for j in range(len(epsilon)):
                    delta[:, j, :, :].uniform_(-epsilon[j][0][0].item(), epsilon[j][0][0].item())
                delta.data = clamp(delta, lower_limit - X, upper_limit - X)
            delta.requires_grad = True

            if args.attack_eval:
                model.eval()
            for _ in range(args.attack_iters):
                with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=use_amp):
                    output = model(X + delta)
                    loss = criterion(output, y)
                if args.attack_grad == 'backward':
                    scaler.scale(loss).backward()
                    grad = delta.grad.detach()
                else:
                    grad = torch.autograd.grad(scaler.scale(loss), delta)[0].detach()
                delta.data = clamp(delta + alpha * torch.sign(grad), -epsilon, epsilon)
                delta.data = clamp(delta, lower_limit - X, upper_limit - X)
                if delta.grad is not None:
                    delta.grad.zero_()
            delta = delta.detach()
            model.train()

            with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=use_amp):
                output = model(clamp(X + delta[:X.size(0)], lower_limit, upper_limit))
                loss = criterion(output, y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

            train_loss += loss.item() * y.size(0)
            train_acc += (output.max(1)[1] == y).sum().item()
            train_n += y.size(0)
            scheduler.step()

            step += 1
            if step % 10 == 0 or step == 1:
                lr = scheduler.get_last_lr()[0]
                print(f"epoch {epoch} step {step} lr {lr:.4f} loss {train_loss / train_n:.4f} "
                      f"acc {train_acc / train_n:.4f} ({time.time() - start_train_time:.1f}s)")
            if args.max_steps is not None and step >= args.max_steps:
                break
        if args.max_steps is not None and step >= args.max_steps:
            break

    if torch.cuda.is_available():
        print(f"max memory allocated: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
