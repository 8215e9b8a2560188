# Second-order MAML by hand (learn2learn / "higher"-free research-repo habit):
# inner-loop SGD on fast weights via torch.autograd.grad(create_graph=True),
# functional forward with torch.func.functional_call, meta-update with Adam.
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

N_WAY, K_SHOT, K_QUERY, META_BATCH, INNER_STEPS, INNER_LR, META_STEPS = 5, 5, 15, 16, 5, 0.01, 8


def conv_block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout, track_running_stats=False),
                         nn.ReLU(), nn.MaxPool2d(2))


class Conv4(nn.Module):  # the standard MAML Omniglot / miniImageNet backbone
    def __init__(self, n_way, hidden=64):
        super().__init__()
        self.encoder = nn.Sequential(conv_block(3, hidden), conv_block(hidden, hidden),
                                     conv_block(hidden, hidden), conv_block(hidden, hidden))
        self.head = nn.Linear(hidden * 5 * 5, n_way)

    def forward(self, x):
        return self.head(self.encoder(x).flatten(1))


def sample_tasks(device):
    # fake miniImageNet-sized tasks: 84x84 RGB
    xs = torch.randn(META_BATCH, N_WAY * K_SHOT, 3, 84, 84, device=device)
    ys = torch.arange(N_WAY, device=device).repeat_interleave(K_SHOT).expand(META_BATCH, -1)
    xq = torch.randn(META_BATCH, N_WAY * K_QUERY, 3, 84, 84, device=device)
    yq = torch.arange(N_WAY, device=device).repeat_interleave(K_QUERY).expand(META_BATCH, -1)
    return xs, ys, xq, yq


def main():
    torch.manual_seed(0)
    device = "cuda"
    model = Conv4(N_WAY).to(device)
    meta_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for it in range(META_STEPS):
        xs, ys, xq, yq = sample_tasks(device)
        meta_opt.zero_grad()
        qry_losses, qry_accs = [], []
        for t in range(META_BATCH):
            fast = dict(model.named_parameters())
            for _ in range(INNER_STEPS):
                loss = F.cross_entropy(functional_call(model, fast, (xs[t],)), ys[t])
                grads = torch.autograd.grad(loss, list(fast.values()), create_graph=True)
                fast = {n: p - INNER_LR * g for (n, p), g in zip(fast.items(), grads)}
            logits = functional_call(model, fast, (xq[t],))
            qry_loss = F.cross_entropy(logits, yq[t])
            (qry_loss / META_BATCH).backward()  # second-order: through the inner loop
            qry_losses.append(qry_loss.detach())
            qry_accs.append((logits.argmax(1) == yq[t]).float().mean())
        meta_opt.step()
        print(f"meta-iter {it}: query loss {torch.stack(qry_losses).mean().item():.4f} "
              f"acc {torch.stack(qry_accs).mean().item():.3f} "
              f"peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
