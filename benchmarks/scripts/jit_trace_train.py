"""Older production habit: torch.jit.trace a CNN (or MLP) and train the traced module, with a @torch.jit.script focal loss."""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


@torch.jit.script
def focal_loss(logits: torch.Tensor, target: torch.Tensor, gamma: float = 2.0, alpha: float = 0.25) -> torch.Tensor:
    logp = F.log_softmax(logits, dim=-1)
    logp_t = logp.gather(1, target.unsqueeze(1)).squeeze(1)
    p_t = logp_t.exp()
    loss = -alpha * (1.0 - p_t) ** gamma * logp_t
    return loss.mean()


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ConvNet(nn.Module):
    def __init__(self, width=64, num_classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(3, 2, 1))
        layers, cin = [], width
        for i, n in enumerate([2, 2, 2, 2]):
            cout = width * 2 ** i
            for j in range(n):
                layers.append(BasicBlock(cin, cout, 2 if (j == 0 and i > 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


class MLP(nn.Module):
    def __init__(self, in_features, hidden, depth, num_classes):
        super().__init__()
        layers = [nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(0.1)]
        layers.append(nn.Linear(hidden, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def main():
    parser = argparse.ArgumentParser(description="Train a TorchScript (traced or scripted) model")
    parser.add_argument("--arch", default="cnn", choices=["cnn", "mlp"])
    parser.add_argument("--width", type=int, default=64, help="CNN base width")
    parser.add_argument("--hidden", type=int, default=4096, help="MLP hidden size")
    parser.add_argument("--depth", type=int, default=8, help="MLP depth")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("-b", "--batch-size", type=int, default=128)
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wd", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--script", action="store_true", help="torch.jit.script the model instead of tracing it")
    parser.add_argument("--print-freq", type=int, default=2)
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True

    if args.arch == "cnn":
        model = ConvNet(args.width, args.num_classes)
    else:
        model = MLP(3 * args.image_size * args.image_size, args.hidden, args.depth, args.num_classes)
    model = model.to(device)
    model.train()

    example = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    if args.script:
        jit_model = torch.jit.script(model)
    else:
        # check_trace=False: dropout makes the re-run differ from the trace.
        jit_model = torch.jit.trace(model, example, check_trace=False)
    jit_model.train()
    print("=> using {} model, {:.2f}M parameters".format(
        "scripted" if args.script else "traced", sum(p.numel() for p in jit_model.parameters()) / 1e6))

    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(jit_model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.wd)
    else:
        optimizer = torch.optim.Adam(jit_model.parameters(), lr=args.lr * 1e-2, weight_decay=args.wd)

    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    target = torch.randint(0, args.num_classes, (args.batch_size,), device=device)

    end = time.time()
    for i in range(args.steps):
        output = jit_model(images)
        loss = focal_loss(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if i % args.print_freq == 0 or i == args.steps - 1:
            torch.cuda.synchronize()
            acc1 = (output.argmax(1) == target).float().mean() * 100
            print("Step: [{0}/{1}]\tTime {2:.3f}\tLoss {3:.4e}\tAcc@1 {4:.2f}\tMem {5:.2f} GiB".format(
                i, args.steps, time.time() - end, loss.item(), acc1.item(),
                torch.cuda.max_memory_allocated() / 2**30))
            end = time.time()


if __name__ == "__main__":
    main()
