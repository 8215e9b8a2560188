# model.half() training with a manual loss scale, einsum attention, and torch.no_grad eval every 2 steps.
import torch, torch.nn as nn
torch.manual_seed(0)
class Attn(nn.Module):
    def __init__(s, d=512, h=8):
        super().__init__(); s.h = h; s.qkv = nn.Linear(d, 3 * d); s.o = nn.Linear(d, d); s.ln = nn.LayerNorm(d)
    def forward(s, x):
        B, T, D = x.shape
        q, k, v = s.qkv(s.ln(x)).view(B, T, 3, s.h, D // s.h).unbind(2)
        a = torch.einsum("bthd,bshd->bhts", q, k) / (D // s.h) ** 0.5
        a = a.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1), float("-inf")).softmax(-1)
        return x + s.o(torch.einsum("bhts,bshd->bthd", a, v).reshape(B, T, D))
model = nn.Sequential(nn.Embedding(1000, 512), *[Attn() for _ in range(4)], nn.Linear(512, 1000)).cuda().half()
opt = torch.optim.Adam(model.parameters(), lr=1e-4, eps=1e-4)
for step in range(6):
    ids = torch.randint(0, 1000, (8, 256)).cuda()
    logits = model(ids)
    loss = nn.functional.cross_entropy(logits.float().view(-1, 1000), ids.view(-1))
    (loss * 128).backward()
    for p in model.parameters():
        p.grad.div_(128)
    opt.step(); opt.zero_grad()
    if step % 2 == 0:
        model.eval()
        with torch.no_grad():
            model(ids[:2])
        model.train()
    print(step, loss.item())
