"""Small models of known shapes shared by the tests."""

import torch
from torch import nn

MiB = 1 << 20


def mlp(bias: bool = False) -> nn.Sequential:
    """Two 512x512 fp32 layers: each weight is exactly 1 MiB."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512, bias=bias), nn.ReLU(), nn.Linear(512, 512, bias=bias))


class TiedLM(nn.Module):
    """Embedding and output projection share one weight (as GPT-2 does)."""

    def __init__(self, vocab: int = 256, dim: int = 1024) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.proj(self.embed(ids))))


def train(model, opt, x, steps: int, loss_fn=lambda y: y.square().mean()) -> None:
    for _ in range(steps):
        loss = loss_fn(model(x))
        loss.backward()
        opt.step()
        opt.zero_grad()


class FF(nn.Module):
    """Residual feed-forward block: 256 -> 1024 -> 256, no biases. Each weight
    is 256*1024*4 B = 1 MiB, so a block holds 2 MiB of parameters: a repeated
    block for checkpointing, with large activations for a big batch."""

    def __init__(self, d: int = 256) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d, bias=False)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


def adam_linear():
    """Adam's foreach temporaries on a 4 MiB weight and a one-row batch: on a
    (simulated) GPU the steady step peaks inside optimizer.step(). A setup
    for memprof.simulate: (model, optimizer, step)."""
    model = nn.Linear(1024, 1024, bias=False).cuda()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(1, 1024, device="cuda")

    def step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    return model, opt, step
