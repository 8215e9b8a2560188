# Graph classification with a GIN/GraphSAGE stack written without PyG: a host collate_fn that
# concatenates variable-size random graphs (edge_index offsets, a `batch` vector), message passing
# with index_add_ (GIN, sum) and scatter_reduce(reduce="mean", include_self=False) (GraphSAGE)
# on the GPU, global mean pooling by index_add_ / bincount, BatchNorm1d, AdamW + OneCycleLR.
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

p = argparse.ArgumentParser()
p.add_argument("--hidden", type=int, default=512)
p.add_argument("--layers", type=int, default=5)
p.add_argument("--in_dim", type=int, default=128)
p.add_argument("--classes", type=int, default=10)
p.add_argument("--graphs_per_batch", type=int, default=200)
p.add_argument("--min_nodes", type=int, default=300)
p.add_argument("--max_nodes", type=int, default=700)
p.add_argument("--avg_degree", type=int, default=10)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--dropout", type=float, default=0.2)
p.add_argument("--workers", type=int, default=0)
p.add_argument("--device", default="cuda")
args = p.parse_args()

device = torch.device(args.device)
torch.manual_seed(0)


# ---------------------------------------------------------------- data (host side)
class RandomGraphs(Dataset):
    """Synthetic graph-classification set: each item a graph of random size."""

    def __init__(self, n, in_dim, classes, min_nodes, max_nodes, avg_degree, seed=0):
        self.n, self.in_dim, self.classes = n, in_dim, classes
        self.min_nodes, self.max_nodes, self.avg_degree, self.seed = min_nodes, max_nodes, avg_degree, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 100003 + i)
        num_nodes = int(torch.randint(self.min_nodes, self.max_nodes + 1, (1,), generator=g))
        num_edges = num_nodes * self.avg_degree
        x = torch.randn(num_nodes, self.in_dim, generator=g)
        src = torch.randint(0, num_nodes, (num_edges,), generator=g)
        dst = torch.randint(0, num_nodes, (num_edges,), generator=g)
        edge_index = torch.stack([src, dst])
        y = int(torch.randint(0, self.classes, (1,), generator=g))
        return {"x": x, "edge_index": edge_index, "y": y, "num_nodes": num_nodes}


def collate_graphs(items):
    xs, eis, batch, ys = [], [], [], []
    offset = 0
    for gi, it in enumerate(items):
        xs.append(it["x"])
        eis.append(it["edge_index"] + offset)
        batch.append(torch.full((it["num_nodes"],), gi, dtype=torch.long))
        ys.append(it["y"])
        offset += it["num_nodes"]
    return {
        "x": torch.cat(xs, 0),
        "edge_index": torch.cat(eis, 1),
        "batch": torch.cat(batch, 0),
        "y": torch.tensor(ys, dtype=torch.long),
        "num_graphs": len(items),
    }


# ---------------------------------------------------------------- model
class GINConv(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.eps = nn.Parameter(torch.zeros(1))
        self.mlp = nn.Sequential(nn.Linear(d_in, d_out), nn.BatchNorm1d(d_out), nn.ReLU(), nn.Linear(d_out, d_out))

    def forward(self, x, edge_index):
        src, dst = edge_index[0], edge_index[1]
        # sum aggregation: out[dst] += x[src]
        agg = torch.zeros_like(x).index_add_(0, dst, x.index_select(0, src))
        return self.mlp((1 + self.eps) * x + agg)


class SAGEConv(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.lin_l = nn.Linear(d_in, d_out)
        self.lin_r = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x, edge_index):
        src, dst = edge_index[0], edge_index[1]
        msg = x[src]
        index = dst.unsqueeze(-1).expand_as(msg)
        # mean aggregation over incoming edges; isolated nodes keep 0
        agg = x.new_zeros(x.shape).scatter_reduce(0, index, msg, reduce="mean", include_self=False)
        return self.lin_l(agg) + self.lin_r(x)


class GNN(nn.Module):
    def __init__(self, in_dim, hidden, layers, classes, dropout):
        super().__init__()
        self.encoder = nn.Linear(in_dim, hidden)
        self.convs = nn.ModuleList()
        self.norms = nn.ModuleList()
        for i in range(layers):
            self.convs.append(GINConv(hidden, hidden) if i % 2 == 0 else SAGEConv(hidden, hidden))
            self.norms.append(nn.BatchNorm1d(hidden))
        self.dropout = dropout
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, classes))

    def forward(self, x, edge_index, batch, num_graphs):
        x = self.encoder(x)
        for conv, norm in zip(self.convs, self.norms):
            h = conv(x, edge_index)
            h = F.relu(norm(h))
            h = F.dropout(h, p=self.dropout, training=self.training)
            x = x + h
        # global mean pool
        counts = torch.bincount(batch, minlength=num_graphs).clamp(min=1).to(x.dtype).unsqueeze(1)
        pooled = torch.zeros(num_graphs, x.size(1), device=x.device, dtype=x.dtype).index_add_(0, batch, x) / counts
        return self.head(pooled)


model = GNN(args.in_dim, args.hidden, args.layers, args.classes, args.dropout).to(device)
print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")

dataset = RandomGraphs(args.graphs_per_batch * args.steps, args.in_dim, args.classes,
                       args.min_nodes, args.max_nodes, args.avg_degree)
loader = DataLoader(dataset, batch_size=args.graphs_per_batch, shuffle=True, collate_fn=collate_graphs,
                    num_workers=args.workers, pin_memory=(device.type == "cuda"), drop_last=True)

optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=len(loader),
                                                pct_start=0.3)

model.train()
for step, data in enumerate(loader):
    t0 = time.time()
    x = data["x"].to(device, non_blocking=True)
    edge_index = data["edge_index"].to(device, non_blocking=True)
    batch = data["batch"].to(device, non_blocking=True)
    y = data["y"].to(device, non_blocking=True)
    num_graphs = int(batch.max()) + 1          # PyG's Batch.num_graphs habit, read back from the device

    optimizer.zero_grad(set_to_none=True)
    out = model(x, edge_index, batch, num_graphs)
    loss = F.cross_entropy(out, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()

    acc = (out.argmax(-1) == y).float().mean().item()
    print(f"step {step} nodes {x.size(0)} edges {edge_index.size(1)} graphs {num_graphs} "
          f"loss {loss.item():.4f} acc {acc:.3f} lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.2f}s")
