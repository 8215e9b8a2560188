# Older code: torch.cuda.amp.autocast / GradScaler, reentrant checkpointing, Variable-era habits.
import torch, torch.nn as nn
from torch.utils.checkpoint import checkpoint
class Block(nn.Module):
    def __init__(s, d):
        super().__init__(); s.f = nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(inplace=True), nn.Linear(4 * d, d)); s.n = nn.LayerNorm(d)
    def forward(s, x):
        return x + s.f(s.n(x))
class Net(nn.Module):
    def __init__(s, d=1024, n=8):
        super().__init__(); s.blocks = nn.ModuleList(Block(d) for _ in range(n)); s.head = nn.Linear(d, 100)
    def forward(s, x):
        x.requires_grad_(True)
        for b in s.blocks:
            x = checkpoint(b, x, use_reentrant=True)
        return s.head(x)
net = Net().cuda()
opt = torch.optim.Adam(net.parameters(), lr=3e-4, amsgrad=True)
scaler = torch.cuda.amp.GradScaler()
for it in range(5):
    x = torch.randn(64, 512, 1024).cuda()
    y = torch.randint(0, 100, (64 * 512,)).cuda()
    with torch.cuda.amp.autocast():
        loss = nn.CrossEntropyLoss()(net(x).view(-1, 100), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt); scaler.update()
    print(it, loss.data.cpu().numpy())
