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
