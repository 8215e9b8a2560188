# MAML on Omniglot-shaped tasks with torch.func, after pytorch/functorch's
# examples/maml_omniglot/maml-omniglot-transforms.py: the per-task loss adapts a copy of the
# parameters with 5 inner SGD steps computed functionally (torch.func.grad of a functional_call
# loss, new_params = {k: p - alpha * g[k]}), evaluates the adapted parameters on the query set,
# and torch.func.vmap runs that per-task function over the whole task batch. The outer
# qry_losses.sum().backward() differentiates through the inner loop (second-order MAML), and
# Adam updates the meta-parameters. Conv-4 backbone (4 x [conv3x3-64, BatchNorm without running
# stats, ReLU, maxpool]) on 28x28 grayscale, 5-way 5-shot, 15 queries per class, 32 tasks a batch.
# The support images get a little Gaussian noise inside the vmapped function (randomness="different":
# each task draws its own).
import argparse
import functools
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1),
        nn.BatchNorm2d(cout, momentum=1.0, affine=True, track_running_stats=False),
        nn.ReLU(inplace=False),  # in-place ops do not mix with vmap over the task batch
        nn.MaxPool2d(2, 2),
    )


class Conv4(nn.Module):
    def __init__(self, n_way, in_channels=1, hidden=64):
        super().__init__()
        self.features = nn.Sequential(
            conv_block(in_channels, hidden), conv_block(hidden, hidden),
            conv_block(hidden, hidden), conv_block(hidden, hidden))
        self.classifier = nn.Linear(hidden, n_way)  # 28 -> 14 -> 7 -> 3 -> 1

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


class OmniglotNShotFake:
    """Stands in for the example's OmniglotNShot loader: random images, balanced labels."""

    def __init__(self, batchsz, n_way, k_shot, k_query, imgsz, device):
        self.batchsz, self.n_way, self.k_shot, self.k_query = batchsz, n_way, k_shot, k_query
        self.imgsz, self.device = imgsz, device

    def next(self):
        n, ks, kq = self.n_way, self.k_shot, self.k_query
        x_spt = torch.randn(self.batchsz, n * ks, 1, self.imgsz, self.imgsz, device=self.device)
        x_qry = torch.randn(self.batchsz, n * kq, 1, self.imgsz, self.imgsz, device=self.device)
        y_spt = torch.arange(n, device=self.device).repeat_interleave(ks).expand(self.batchsz, -1)
        y_qry = torch.arange(n, device=self.device).repeat_interleave(kq).expand(self.batchsz, -1)
        return x_spt, y_spt.contiguous(), x_qry, y_qry.contiguous()


def loss_for_task(net, n_inner_iter, inner_lr, noise, x_spt, y_spt, x_qry, y_qry):
    params = dict(net.named_parameters())
    buffers = dict(net.named_buffers())
    querysz = x_qry.size(0)

    def compute_loss(new_params, buffers, x, y):
        logits = functional_call(net, (new_params, buffers), x)
        return F.cross_entropy(logits, y)

    x_spt = x_spt + noise * torch.randn_like(x_spt)  # per-task augmentation (vmap randomness)
    new_params = params
    for _ in range(n_inner_iter):
        grads = grad(compute_loss)(new_params, buffers, x_spt, y_spt)
        new_params = {k: new_params[k] - g * inner_lr for k, g in grads.items()}

    # The adapted parameters' loss and accuracy on the query set drive the meta-update.
    qry_logits = functional_call(net, (new_params, buffers), x_qry)
    qry_loss = F.cross_entropy(qry_logits, y_qry)
    qry_acc = (qry_logits.argmax(dim=1) == y_qry).sum() / querysz
    return qry_loss, qry_acc


def get_args():
    p = argparse.ArgumentParser(description="MAML (second order) with torch.func transforms")
    p.add_argument("--n-way", type=int, default=5)
    p.add_argument("--k-spt", type=int, default=5)
    p.add_argument("--k-qry", type=int, default=15)
    p.add_argument("--task-num", type=int, default=32)
    p.add_argument("--imgsz", type=int, default=28)
    p.add_argument("--inner-steps", type=int, default=5)
    p.add_argument("--inner-lr", type=float, default=1e-1)
    p.add_argument("--meta-lr", type=float, default=1e-3)
    p.add_argument("--noise", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cuda")
    return p.parse_args()


def main():
    args = get_args()
    torch.manual_seed(args.seed)
    device = args.device  # "cuda"

    db = OmniglotNShotFake(args.task_num, args.n_way, args.k_spt, args.k_qry, args.imgsz, device)
    net = Conv4(args.n_way).to(device)
    net.train()
    meta_opt = torch.optim.Adam(net.parameters(), lr=args.meta_lr)

    for step in range(args.steps):
        start_time = time.time()
        x_spt, y_spt, x_qry, y_qry = db.next()

        meta_opt.zero_grad()
        # In parallel, adapt one model per task: each task's support set drives its own inner loop.
        compute_loss_for_task = functools.partial(loss_for_task, net, args.inner_steps, args.inner_lr, args.noise)
        qry_losses, qry_accs = vmap(compute_loss_for_task, randomness="different")(x_spt, y_spt, x_qry, y_qry)

        # The MAML objective: the sum of the query losses, differentiated through the inner loop.
        qry_losses.sum().backward()
        meta_opt.step()

        qry_losses = qry_losses.detach().sum() / args.task_num
        qry_accs = 100.0 * qry_accs.sum() / args.task_num
        print(f"step {step}: qry loss {qry_losses.item():.3f} qry acc {qry_accs.item():.2f} "
              f"time {time.time() - start_time:.2f}s")

    if str(device).startswith("cuda"):
        print(f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
              f"reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
