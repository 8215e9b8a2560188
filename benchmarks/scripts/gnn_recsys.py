# Two-tower-ish recommender: EmbeddingBag user history + hand-written GNN (mean aggregation with
# index_add_/scatter_add_ over an item co-occurrence edge list), BPR loss with sampled negatives
# and a top-k ranking loss.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(7)
device = torch.device("cuda")

N_USERS, N_ITEMS, N_CATS = 200_000, 100_000, 500
N_EDGES, DIM, BATCH, MAX_HIST, N_NEG = 2_000_000, 128, 4096, 50, 20

# ---- synthetic graph (item-item co-occurrence), built on the GPU ----
src = torch.randint(0, N_ITEMS, (N_EDGES,), device=device)
dst = torch.randint(0, N_ITEMS, (N_EDGES,), device=device)
keep = src != dst                       # drop self loops by boolean masking
src, dst = src[keep], dst[keep]
edge_index = torch.stack([torch.cat([src, dst]), torch.cat([dst, src])])   # symmetrize
# dedupe edges via a linear key + torch.unique
key = edge_index[0] * N_ITEMS + edge_index[1]
key = torch.unique(key)
edge_index = torch.stack([key // N_ITEMS, key % N_ITEMS])
deg = torch.bincount(edge_index[1], minlength=N_ITEMS).float()
print(f"edges after dedupe: {edge_index.size(1)}, isolated items: {(deg == 0).sum().item()}")
item_cat = torch.randint(0, N_CATS, (N_ITEMS,), device=device)
# sparse normalized adjacency for a second propagation path
norm = deg.clamp(min=1).rsqrt()
vals = norm[edge_index[0]] * norm[edge_index[1]]
adj = torch.sparse_coo_tensor(edge_index, vals, (N_ITEMS, N_ITEMS)).coalesce()


class MeanConv(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin_self = nn.Linear(dim, dim)
        self.lin_nei = nn.Linear(dim, dim, bias=False)

    def forward(self, x, edge_index, deg):
        s, d = edge_index
        msg = x.index_select(0, s)
        # edge gates normalized per destination node (scatter_add_ softmax-ish)
        w = torch.sigmoid((msg * x.index_select(0, d)).sum(-1)) + 1e-6
        denom = torch.zeros(x.size(0), device=x.device, dtype=x.dtype).scatter_add_(0, d, w)
        msg = msg * (w / denom[d]).unsqueeze(-1)
        agg = torch.zeros_like(x).index_add_(0, d, msg)
        return F.relu(self.lin_self(x) + self.lin_nei(agg))


class GraphRec(nn.Module):
    def __init__(self):
        super().__init__()
        self.item_emb = nn.Embedding(N_ITEMS, DIM)
        self.cat_emb = nn.Embedding(N_CATS, DIM)
        self.user_emb = nn.Embedding(N_USERS, DIM)
        self.hist_bag = nn.EmbeddingBag(N_ITEMS, DIM, mode="mean")
        self.convs = nn.ModuleList([MeanConv(DIM) for _ in range(2)])
        self.user_mlp = nn.Sequential(nn.Linear(2 * DIM, 256), nn.ReLU(), nn.Linear(256, DIM))
        nn.init.normal_(self.item_emb.weight, std=0.05)
        nn.init.normal_(self.user_emb.weight, std=0.05)

    def item_repr(self):
        x = self.item_emb.weight + self.cat_emb(item_cat)
        for conv in self.convs:
            x = x + conv(x, edge_index, deg)
        # LightGCN-style sparse propagation on top
        x = 0.5 * x + 0.5 * torch.sparse.mm(adj, x)
        return x

    def user_repr(self, users, hist_flat, hist_offsets):
        bag = self.hist_bag(hist_flat, hist_offsets)
        return self.user_mlp(torch.cat([self.user_emb(users), bag], dim=-1))


def sample_batch():
    users = torch.randint(0, N_USERS, (BATCH,), device=device)
    lens = torch.randint(1, MAX_HIST + 1, (BATCH,), device=device)
    offsets = torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)[:-1]])
    hist = torch.randint(0, N_ITEMS, (int(lens.sum().item()),), device=device)
    pos = torch.randint(0, N_ITEMS, (BATCH,), device=device)
    neg = torch.randint(0, N_ITEMS, (BATCH, N_NEG), device=device)
    return users, hist, offsets, pos, neg


model = GraphRec().to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

for step in range(8):
    users, hist, offsets, pos, neg = sample_batch()
    optimizer.zero_grad()
    items = model.item_repr()
    u = model.user_repr(users, hist, offsets)
    pos_s = (u * items[pos]).sum(-1)
    neg_s = torch.einsum("bd,bnd->bn", u, items[neg])
    # BPR on the hardest negatives
    hard, hard_idx = torch.topk(neg_s, k=5, dim=1)
    bpr = -F.logsigmoid(pos_s.unsqueeze(1) - hard).mean()
    # which negatives accidentally beat the positive? (one-arg where / nonzero)
    violators = torch.where(neg_s > pos_s.unsqueeze(1))
    viol_rows = torch.nonzero(neg_s.max(1).values > pos_s).squeeze(1)
    # listwise softmax ranking loss over positive + sorted negatives
    scores = torch.cat([pos_s.unsqueeze(1), neg_s], dim=1)
    sorted_scores, order = torch.sort(scores, dim=1, descending=True)
    rank_of_pos = (order == 0).nonzero()[:, 1].float()
    listwise = F.cross_entropy(scores, torch.zeros(BATCH, dtype=torch.long, device=device))
    # regularize only the embeddings touched this batch
    touched = torch.unique(torch.cat([pos, neg.flatten(), hist]))
    reg = 1e-5 * model.item_emb.weight[touched].pow(2).sum() / touched.numel()
    loss = bpr + listwise + reg
    loss.backward()
    optimizer.step()
    mrr = (1.0 / (rank_of_pos + 1)).mean()
    print(f"step {step} loss {loss.item():.4f} bpr {bpr.item():.4f} list {listwise.item():.4f} "
          f"mrr {mrr.item():.3f} violators {violators[0].numel()} rows {viol_rows.numel()} touched {touched.numel()}")
