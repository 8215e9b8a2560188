"""A minimal training loop: an MLP classifier on random data.

``python examples/train_mlp.py --steps 3`` or ``memprof track examples/train_mlp.py``.
"""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser(description="minimal MLP training loop")
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = p.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
model.to(args.device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
loss_fn = nn.CrossEntropyLoss()

for step in range(args.steps):
    x = torch.randn(args.batch_size, 784, device=args.device)
    y = torch.randint(10, (args.batch_size,), device=args.device)
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if step % 100 == 0:
        print(f"step {step}: loss {loss.item():.4f}")
