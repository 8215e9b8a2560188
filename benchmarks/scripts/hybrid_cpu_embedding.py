# Hybrid CPU/GPU recommender in the style of DLRM's CPU-resident tables (facebookresearch/dlrm
# dlrm_s_pytorch.py with the embeddings left on the host), torchrec's CPU-offloaded tables and
# the many Kaggle kernels that keep a big nn.Embedding in RAM: `nn.Embedding(num, dim,
# sparse=True)` stays on "cpu" and is trained by `torch.optim.SparseAdam` on the CPU; multi-hot
# lookups are mean-pooled on the CPU, then `.pin_memory().to(device, non_blocking=True)` moves the
# pooled (B, F, D) block to the GPU, where a bottom MLP, DLRM's dot interaction and a top MLP run
# under `torch.cuda.amp.autocast(dtype=torch.bfloat16)` (the legacy spelling) with AdamW;
# backward crosses back to the CPU (the copy's gradient lands on the host table as a sparse
# gradient); both optimizers step every iteration. Batches come from a map-style Dataset through a
# DataLoader with pin_memory=True and num_workers=0. Random ids stand in for Criteo, so it runs
# offline.
#
#     python hybrid_cpu_embedding.py --num-embeddings 1000000 --emb-dim 64 --batch-size 2048 --max-steps 10
import argparse
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class SyntheticClicks(Dataset):
    def __init__(self, n, num_dense, num_sparse, hotness, num_embeddings, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.dense = torch.rand(n, num_dense, generator=g).log1p()
        self.sparse = torch.randint(0, num_embeddings, (n, num_sparse, hotness), generator=g)
        self.labels = (torch.rand(n, generator=g) < 0.25).float()

    def __len__(self):
        return self.labels.shape[0]

    def __getitem__(self, i):
        return self.dense[i], self.sparse[i], self.labels[i]


def mlp(sizes, last_act=True):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_act:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DenseTower(nn.Module):
    """The GPU half: bottom MLP, pairwise dot interaction, top MLP (logits)."""

    def __init__(self, num_dense, emb_dim, num_sparse, bot, top):
        super().__init__()
        self.bot = mlp([num_dense] + bot + [emb_dim])
        num_fea = num_sparse + 1
        num_int = num_fea * (num_fea - 1) // 2 + emb_dim
        self.top = mlp([num_int] + top + [1], last_act=False)
        li, lj = torch.tril_indices(num_fea, num_fea, offset=-1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)

    def forward(self, dense_x, pooled):
        x = self.bot(dense_x)                                   # (B, D)
        T = torch.cat([x.unsqueeze(1), pooled.to(x.dtype)], dim=1)  # (B, F+1, D)
        Z = torch.bmm(T, T.transpose(1, 2))
        Zflat = Z[:, self.li, self.lj]
        R = torch.cat([x, Zflat], dim=1)
        return self.top(R).squeeze(-1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-embeddings", type=int, default=1_000_000)
    parser.add_argument("--emb-dim", type=int, default=64)
    parser.add_argument("--num-sparse", type=int, default=8)
    parser.add_argument("--hotness", type=int, default=4)
    parser.add_argument("--num-dense", type=int, default=13)
    parser.add_argument("--bot-mlp", type=str, default="512-256")
    parser.add_argument("--top-mlp", type=str, default="1024-1024-512-256")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--num-samples", type=int, default=16384)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--emb-lr", type=float, default=1e-2)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--no-amp", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")

    # the big table lives in host RAM; only the tower goes to the GPU
    embedding = nn.Embedding(args.num_embeddings, args.emb_dim, sparse=True)
    nn.init.uniform_(embedding.weight, -0.05, 0.05)
    tower = DenseTower(args.num_dense, args.emb_dim, args.num_sparse,
                       [int(s) for s in args.bot_mlp.split("-")],
                       [int(s) for s in args.top_mlp.split("-")]).to(device)

    emb_optimizer = torch.optim.SparseAdam(embedding.parameters(), lr=args.emb_lr)
    dense_optimizer = torch.optim.AdamW(tower.parameters(), lr=args.lr, weight_decay=1e-5)
    criterion = nn.BCEWithLogitsLoss()

    dataset = SyntheticClicks(args.num_samples, args.num_dense, args.num_sparse, args.hotness,
                              args.num_embeddings)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        pin_memory=True, num_workers=0)
    amp = use_cuda and not args.no_amp

    step = 0
    start = time.time()
    done = False
    while not done:
        for dense_x, sparse_ids, labels in loader:
            dense_x = dense_x.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)

            # CPU lookup + mean pooling over the multi-hot ids: (B, F, H, D) -> (B, F, D)
            pooled = embedding(sparse_ids).mean(dim=2)
            if use_cuda:
                pooled = pooled.pin_memory().to(device, non_blocking=True)

            with torch.cuda.amp.autocast(enabled=amp, dtype=torch.bfloat16):
                logits = tower(dense_x, pooled)
                loss = criterion(logits.float(), labels)

            emb_optimizer.zero_grad()
            dense_optimizer.zero_grad(set_to_none=True)
            loss.backward()                     # the copy's backward sends the grad to the CPU table
            dense_optimizer.step()
            emb_optimizer.step()

            step += 1
            if step % 5 == 0 or step == 1:
                if use_cuda:
                    torch.cuda.synchronize()
                print(f"step {step} loss {loss.item():.4f} ({time.time() - start:.1f}s)")
            if args.max_steps is not None and step >= args.max_steps:
                done = True
                break

    if use_cuda:
        print(f"max memory allocated: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
