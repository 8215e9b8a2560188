"""Tabular regression MLP with BatchNorm/Dropout, ReduceLROnPlateau on a
validation loss, and gradient value clipping (Kaggle-notebook style)."""
import argparse

import torch
import torch.nn as nn


class TabularMLP(nn.Module):
    def __init__(self, n_features, hidden=(2048, 2048, 1024), dropout=0.2, n_out=1):
        super().__init__()
        layers, d = [], n_features
        for h in hidden:
            layers += [nn.Linear(d, h), nn.BatchNorm1d(h), nn.SiLU(), nn.Dropout(dropout)]
            d = h
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(d, n_out)

    def forward(self, x):
        return self.head(self.body(x)).squeeze(-1)


def make_data(n, n_features, device, gen):
    x = torch.randn(n, n_features, generator=gen)
    w = torch.randn(n_features, generator=gen) / n_features ** 0.5
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, generator=gen)
    return x.to(device), y.to(device)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n-features", type=int, default=512)
    p.add_argument("--n-train", type=int, default=65536)
    p.add_argument("--n-val", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()

    device = "cuda"
    gen = torch.Generator().manual_seed(42)
    x_train, y_train = make_data(args.n_train, args.n_features, device, gen)
    x_val, y_val = make_data(args.n_val, args.n_features, device, gen)

    model = TabularMLP(args.n_features).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5,
                                                           patience=args.patience, min_lr=1e-6)
    criterion = nn.MSELoss()

    best = float("inf")
    for step in range(args.steps):
        model.train()
        idx = torch.randint(0, args.n_train, (args.batch_size,), device=device)
        xb, yb = x_train[idx], y_train[idx]
        optimizer.zero_grad()
        pred = model(xb)
        loss = criterion(pred, yb)
        loss.backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), args.clip)
        optimizer.step()

        model.eval()
        with torch.no_grad():
            val_loss = criterion(model(x_val), y_val).item()
        scheduler.step(val_loss)
        if val_loss < best:
            best = val_loss
        if step % 20 == 0:
            print(f"step {step} train {loss.item():.4f} val {val_loss:.4f} best {best:.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.1e}")


if __name__ == "__main__":
    main()
