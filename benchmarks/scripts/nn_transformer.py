# nn.TransformerEncoder with padding masks, nn.MultiheadAttention pooling, SGD with a warmup LambdaLR.
import torch, torch.nn as nn
class Model(nn.Module):
    def __init__(s, d=768):
        super().__init__()
        s.emb = nn.Embedding(30000, d, padding_idx=0)
        s.pos = nn.Parameter(torch.zeros(1, 512, d))
        layer = nn.TransformerEncoderLayer(d, 12, 3072, dropout=0.1, activation="gelu", batch_first=True, norm_first=True)
        s.enc = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)
        s.pool = nn.MultiheadAttention(d, 12, batch_first=True)
        s.q = nn.Parameter(torch.randn(1, 1, d))
        s.cls = nn.Linear(d, 5)
    def forward(s, ids, pad):
        h = s.enc(s.emb(ids) + s.pos[:, : ids.shape[1]], src_key_padding_mask=pad)
        p, _ = s.pool(s.q.expand(ids.shape[0], -1, -1), h, h, key_padding_mask=pad, need_weights=False)
        return s.cls(p.squeeze(1))
device = "cuda" if torch.cuda.is_available() else "cpu"
m = Model().to(device)
opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
for step in range(5):
    ids = torch.randint(1, 30000, (32, 512), device=device)
    lengths = torch.randint(100, 512, (32,), device=device)
    pad = torch.arange(512, device=device)[None] >= lengths[:, None]
    ids = ids.masked_fill(pad, 0)
    loss = nn.functional.cross_entropy(m(ids, pad), torch.randint(0, 5, (32,), device=device))
    opt.zero_grad(); loss.backward()
    nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step(); sched.step()
    print(step, loss.item())
