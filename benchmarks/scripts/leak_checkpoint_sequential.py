# Deep MLP/conv-free "tabular" net, forum-style loop: loss history kept as tensors (leak),
# checkpoint_sequential, clip_grad_value_, OneCycleLR, DataLoader(pin_memory, num_workers=2)
import argparse, time
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.checkpoint import checkpoint_sequential

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, default=4096)
parser.add_argument("--depth", type=int, default=16)
parser.add_argument("--in_dim", type=int, default=1024)
parser.add_argument("--n", type=int, default=16384)
parser.add_argument("--bs", type=int, default=2048)
parser.add_argument("--segments", type=int, default=4)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--workers", type=int, default=2)
parser.add_argument("--device", default="cuda")
args = parser.parse_args()

def make_model():
    layers = [nn.Linear(args.in_dim, args.width), nn.GELU()]
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, args.width), nn.LayerNorm(args.width), nn.GELU(), nn.Dropout(0.1)]
    layers += [nn.Linear(args.width, 10)]
    return nn.Sequential(*layers)

if __name__ == "__main__":
    X = torch.randn(args.n, args.in_dim)
    Y = torch.randint(0, 10, (args.n,))
    ds = TensorDataset(X, Y)
    loader = DataLoader(ds, batch_size=args.bs, shuffle=True, num_workers=args.workers, pin_memory=True, drop_last=True)
    model = make_model().to(args.device)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, steps_per_epoch=len(loader), epochs=args.epochs)
    losses = []          # <- keeps every loss tensor (and its graph? no: after backward the graph is freed, but the tensor stays on the GPU)
    all_logits = []      # <- "for metrics later": keeps logits with grad history!
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for i, (xb, yb) in enumerate(loader):
            xb, yb = xb.to(args.device, non_blocking=True), yb.to(args.device, non_blocking=True)
            xb.requires_grad_()   # needed by reentrant-style checkpoint tutorials
            out = checkpoint_sequential(model, args.segments, xb, use_reentrant=False)
            loss = criterion(out, yb)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=1.0)
            optimizer.step()
            scheduler.step()
            losses.append(loss)
            all_logits.append(out)
            if i % 2 == 0:
                print(f"epoch {epoch} it {i} loss {sum(losses)/len(losses):.4f} lr {scheduler.get_last_lr()[0]:.4f}")
        print(f"epoch {epoch} done in {time.time()-t0:.1f}s, {len(all_logits)} logits kept")
