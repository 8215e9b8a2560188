# Sharpness-Aware Minimization on a small Wide ResNet, in the style of davda54/sam
# (sam.py and example/train.py, example/utility/bypass_bn.py, example/model/wide_res_net.py):
# a SAM(torch.optim.Optimizer) that wraps SGD with momentum and keeps the unperturbed
# weights in self.state[p]["old_p"]; two forward/backward passes per batch (first_step at w,
# second_step at w + e(w)), BatchNorm running statistics updated on the first pass only.
# Random CIFAR-size images stand in for the dataset, so it runs offline.
#
#     python sam_resnet.py --depth 16 --width-factor 4 --batch-size 128
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm


class SAM(torch.optim.Optimizer):
    def __init__(self, params, base_optimizer, rho=0.05, adaptive=False, **kwargs):
        assert rho >= 0.0, f"Invalid rho, should be non-negative: {rho}"

        defaults = dict(rho=rho, adaptive=adaptive, **kwargs)
        super(SAM, self).__init__(params, defaults)

        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        grad_norm = self._grad_norm()
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)

            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                e_w = (torch.pow(p, 2) if group["adaptive"] else 1.0) * p.grad * scale.to(p)
                p.add_(e_w)  # climb to the local maximum "w + e(w)"

        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.data = self.state[p]["old_p"]  # get back to "w" from "w + e(w)"

        self.base_optimizer.step()  # do the actual "sharpness-aware" update

        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is not None, "Sharpness Aware Minimization requires closure, but it was not provided"
        closure = torch.enable_grad()(closure)  # the closure should do a full forward-backward pass

        self.first_step(zero_grad=True)
        closure()
        self.second_step()

    def _grad_norm(self):
        shared_device = self.param_groups[0]["params"][0].device  # put everything on the same device, in case of model parallelism
        norm = torch.norm(
            torch.stack([
                ((torch.abs(p) if group["adaptive"] else 1.0) * p.grad).norm(p=2).to(shared_device)
                for group in self.param_groups for p in group["params"]
                if p.grad is not None
            ]),
            p=2
        )
        return norm

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self.base_optimizer.param_groups = self.param_groups


# example/utility/bypass_bn.py
def disable_running_stats(model):
    def _disable(module):
        if isinstance(module, _BatchNorm):
            module.backup_momentum = module.momentum
            module.momentum = 0

    model.apply(_disable)


def enable_running_stats(model):
    def _enable(module):
        if isinstance(module, _BatchNorm) and hasattr(module, "backup_momentum"):
            module.momentum = module.backup_momentum

    model.apply(_enable)


# example/utility/loss.py
def smooth_crossentropy(pred, gold, smoothing=0.1):
    n_class = pred.size(1)

    one_hot = torch.full_like(pred, fill_value=smoothing / (n_class - 1))
    one_hot.scatter_(dim=1, index=gold.unsqueeze(1), value=1.0 - smoothing)
    log_prob = F.log_softmax(pred, dim=1)

    return F.kl_div(input=log_prob, target=one_hot, reduction='none').sum(-1)


# example/model/wide_res_net.py
class BasicUnit(nn.Module):
    def __init__(self, channels: int, dropout: float):
        super(BasicUnit, self).__init__()
        self.block = nn.Sequential(
            nn.BatchNorm2d(channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(channels, channels, kernel_size=3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout, inplace=True),
            nn.Conv2d(channels, channels, kernel_size=3, stride=1, padding=1, bias=False),
        )

    def forward(self, x):
        return x + self.block(x)


class DownsampleUnit(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int, dropout: float):
        super(DownsampleUnit, self).__init__()
        self.norm_act = nn.Sequential(
            nn.BatchNorm2d(in_channels),
            nn.ReLU(inplace=True),
        )
        self.block = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout, inplace=True),
            nn.Conv2d(out_channels, out_channels, kernel_size=3, stride=1, padding=1, bias=False),
        )
        self.downsample = nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, padding=0, bias=False)

    def forward(self, x):
        x = self.norm_act(x)
        return self.block(x) + self.downsample(x)


class Block(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int, depth: int, dropout: float):
        super(Block, self).__init__()
        self.block = nn.Sequential(
            DownsampleUnit(in_channels, out_channels, stride, dropout),
            *(BasicUnit(out_channels, dropout) for _ in range(depth))
        )

    def forward(self, x):
        return self.block(x)


class WideResNet(nn.Module):
    def __init__(self, depth: int, width_factor: int, dropout: float, in_channels: int, labels: int):
        super(WideResNet, self).__init__()

        self.filters = [16, 1 * 16 * width_factor, 2 * 16 * width_factor, 4 * 16 * width_factor]
        self.block_depth = (depth - 4) // (3 * 2)

        self.f = nn.Sequential(
            nn.Conv2d(in_channels, self.filters[0], kernel_size=3, stride=1, padding=1, bias=False),
            Block(self.filters[0], self.filters[1], 1, self.block_depth, dropout),
            Block(self.filters[1], self.filters[2], 2, self.block_depth, dropout),
            Block(self.filters[2], self.filters[3], 2, self.block_depth, dropout),
            nn.BatchNorm2d(self.filters[3]),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(output_size=1),
            nn.Flatten(),
            nn.Linear(in_features=self.filters[3], out_features=labels),
        )

        self._initialize()

    def _initialize(self):
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight.data, mode="fan_in", nonlinearity="relu")
                if m.bias is not None:
                    m.bias.data.zero_()
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.data.fill_(1)
                m.bias.data.zero_()
            elif isinstance(m, nn.Linear):
                m.weight.data.zero_()
                m.bias.data.zero_()

    def forward(self, x):
        return self.f(x)


class StepLR:
    def __init__(self, optimizer, learning_rate: float, total_epochs: int):
        self.optimizer = optimizer
        self.total_epochs = total_epochs
        self.base = learning_rate

    def __call__(self, epoch):
        if epoch < self.total_epochs * 3 / 10:
            lr = self.base
        elif epoch < self.total_epochs * 6 / 10:
            lr = self.base * 0.2
        elif epoch < self.total_epochs * 8 / 10:
            lr = self.base * 0.2 ** 2
        else:
            lr = self.base * 0.2 ** 3

        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--adaptive", default=False, action="store_true", help="True if you want to use the Adaptive SAM.")
    parser.add_argument("--batch-size", default=32, type=int)
    parser.add_argument("--depth", default=10, type=int, help="Number of layers.")
    parser.add_argument("--dropout", default=0.0, type=float)
    parser.add_argument("--epochs", default=200, type=int)
    parser.add_argument("--label-smoothing", default=0.1, type=float)
    parser.add_argument("--learning-rate", default=0.1, type=float)
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--rho", default=2.0, type=float)
    parser.add_argument("--weight-decay", default=0.0005, type=float)
    parser.add_argument("--width-factor", default=2, type=int)
    parser.add_argument("--img-size", default=32, type=int)
    parser.add_argument("--batches", default=50, type=int, help="batches per epoch (random data)")
    parser.add_argument("--max-steps", default=None, type=int)
    parser.add_argument("--bf16", action="store_true", help="forward passes under torch.autocast(bfloat16)")
    parser.add_argument("--use-closure", action="store_true", help="optimizer.step(closure) instead of first_step/second_step")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)

    model = WideResNet(args.depth, args.width_factor, args.dropout, in_channels=3, labels=10).to(device)

    base_optimizer = torch.optim.SGD
    optimizer = SAM(model.parameters(), base_optimizer, rho=args.rho, adaptive=args.adaptive,
                    lr=args.learning_rate, momentum=args.momentum, weight_decay=args.weight_decay)
    scheduler = StepLR(optimizer, args.learning_rate, args.epochs)

    def autocast():
        return torch.autocast(device_type="cuda" if device.startswith("cuda") else "cpu",
                              dtype=torch.bfloat16, enabled=args.bf16)

    step = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        model.train()
        for _ in range(args.batches):
            inputs = torch.randn(args.batch_size, 3, args.img_size, args.img_size).to(device)
            targets = torch.randint(0, 10, (args.batch_size,)).to(device)

            if args.use_closure:
                def closure():
                    disable_running_stats(model)
                    with autocast():
                        out = model(inputs)
                    loss = smooth_crossentropy(out.float(), targets, smoothing=args.label_smoothing).mean()
                    loss.backward()
                    return loss

                enable_running_stats(model)
                with autocast():
                    predictions = model(inputs)
                loss = smooth_crossentropy(predictions.float(), targets, smoothing=args.label_smoothing)
                loss.mean().backward()
                optimizer.step(closure)
                optimizer.zero_grad()
            else:
                # first forward-backward step
                enable_running_stats(model)
                with autocast():
                    predictions = model(inputs)
                loss = smooth_crossentropy(predictions.float(), targets, smoothing=args.label_smoothing)
                loss.mean().backward()
                optimizer.first_step(zero_grad=True)

                # second forward-backward step
                disable_running_stats(model)
                with autocast():
                    out2 = model(inputs)
                smooth_crossentropy(out2.float(), targets, smoothing=args.label_smoothing).mean().backward()
                optimizer.second_step(zero_grad=True)

            with torch.no_grad():
                correct = torch.argmax(predictions.data, 1) == targets
                acc = correct.float().mean().item()
                scheduler(epoch)

            step += 1
            if step % 10 == 0 or step == 1:
                print(f"epoch {epoch} step {step} loss {loss.mean().item():.4f} acc {acc:.3f} "
                      f"lr {scheduler.lr():.4f} ({time.time() - t0:.1f}s)")
            if args.max_steps is not None and step >= args.max_steps:
                break
        if args.max_steps is not None and step >= args.max_steps:
            break

    if torch.cuda.is_available():
        print(f"max memory allocated: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
