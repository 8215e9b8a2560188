# Sequence classifier with parametrized layers, trained with Lookahead(RAdam), in the style of
# lonePatient/lookahead_pytorch and timm's (pre-0.9) timm.optim.Lookahead: a torch.optim.Optimizer
# subclass that wraps a base optimizer without calling Optimizer.__init__, shares its param_groups and
# keeps a 'slow_buffer' per parameter in its own self.state, interpolating every k steps.
# The model uses torch.nn.utils.parametrizations.weight_norm (weight = g * v / ||v||, parameters
# parametrizations.weight.original0/1) and parametrizations.orthogonal on Linear layers, an optional
# GRU block, and torch.optim.lr_scheduler.ReduceLROnPlateau stepping on a validation loss computed
# every few steps under torch.no_grad() with model.eval().
import argparse
from collections import OrderedDict, defaultdict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrizations
from torch.optim.optimizer import Optimizer

parser = argparse.ArgumentParser(description="Lookahead(RAdam) on a weight-normed / orthogonal model")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--in-dim", type=int, default=64)
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--depth", type=int, default=3)
parser.add_argument("--num-classes", type=int, default=10)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--val-every", type=int, default=2)
parser.add_argument("--val-batches", type=int, default=2)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--la-k", type=int, default=2)
parser.add_argument("--la-alpha", type=float, default=0.5)
parser.add_argument("--no-rnn", action="store_true")
args = parser.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)


class Lookahead(Optimizer):
    """Lookahead (Zhang et al. 2019), timm 0.3 / lonePatient style."""

    def __init__(self, base_optimizer, alpha=0.5, k=6):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"Invalid slow update rate: {alpha}")
        if not 1 <= k:
            raise ValueError(f"Invalid lookahead steps: {k}")
        defaults = dict(lookahead_alpha=alpha, lookahead_k=k, lookahead_step=0)
        self.base_optimizer = base_optimizer
        self.param_groups = self.base_optimizer.param_groups
        self.defaults = base_optimizer.defaults
        self.defaults.update(defaults)
        self.state = defaultdict(dict)
        # as timm does: Optimizer.__init__ is not called, but torch's step wrapper wants these
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        # manually add our defaults to the param groups
        for name, default in defaults.items():
            for group in self.param_groups:
                group.setdefault(name, default)

    def update_slow(self, group):
        for fast_p in group["params"]:
            if fast_p.grad is None:
                continue
            param_state = self.state[fast_p]
            if "slow_buffer" not in param_state:
                param_state["slow_buffer"] = torch.empty_like(fast_p.data)
                param_state["slow_buffer"].copy_(fast_p.data)
            slow = param_state["slow_buffer"]
            slow.add_(fast_p.data - slow, alpha=group["lookahead_alpha"])
            fast_p.data.copy_(slow)

    def sync_lookahead(self):
        for group in self.param_groups:
            self.update_slow(group)

    def step(self, closure=None):
        loss = self.base_optimizer.step(closure)
        for group in self.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"] == 0:
                self.update_slow(group)
        return loss

    def state_dict(self):
        fast_state_dict = self.base_optimizer.state_dict()
        slow_state = {(id(k) if isinstance(k, torch.Tensor) else k): v for k, v in self.state.items()}
        return {"state": fast_state_dict["state"], "slow_state": slow_state,
                "param_groups": fast_state_dict["param_groups"]}


class ParamBlock(nn.Module):
    """Pre-norm residual MLP block: weight-normed up projection, orthogonal square mixing, weight-normed down."""

    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = parametrizations.weight_norm(nn.Linear(dim, 2 * dim))
        self.mix = parametrizations.orthogonal(nn.Linear(2 * dim, 2 * dim, bias=False))
        self.down = parametrizations.weight_norm(nn.Linear(2 * dim, dim))

    def forward(self, x):
        h = F.gelu(self.up(self.norm(x)))
        h = torch.tanh(self.mix(h))
        return x + self.down(h)


class SeqClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = parametrizations.weight_norm(nn.Linear(args.in_dim, args.hidden))
        self.rnn = None if args.no_rnn else nn.GRU(args.hidden, args.hidden, batch_first=True)
        self.blocks = nn.ModuleList([ParamBlock(args.hidden) for _ in range(args.depth)])
        self.head = parametrizations.orthogonal(nn.Linear(args.hidden, args.num_classes), orthogonal_map="householder")

    def forward(self, x):
        h = self.inp(x)
        if self.rnn is not None:
            h, _ = self.rnn(h)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h.mean(dim=1))


def batch():
    x = torch.randn(args.batch_size, args.seq_len, args.in_dim, device=device)
    y = torch.randint(0, args.num_classes, (args.batch_size,), device=device)
    return x, y


model = SeqClassifier().to(device)
base = torch.optim.RAdam(model.parameters(), lr=args.lr, weight_decay=1e-4)
optimizer = Lookahead(base, alpha=args.la_alpha, k=args.la_k)
scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=1)


def validate():
    model.eval()
    total = 0.0
    with torch.no_grad():
        for _ in range(args.val_batches):
            x, y = batch()
            total += F.cross_entropy(model(x), y, reduction="sum").item()
    model.train()
    return total / (args.val_batches * args.batch_size)


model.train()
for step in range(args.steps):
    x, y = batch()
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    if (step + 1) % args.val_every == 0:
        val_loss = validate()
        scheduler.step(val_loss)
        print(f"step {step + 1} loss {loss.item():.4f} val {val_loss:.4f} lr {optimizer.param_groups[0]['lr']:.2e}")

if torch.cuda.is_available():
    print(f"max memory allocated: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
