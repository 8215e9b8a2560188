# A segmentation net: GroupNorm, ConvTranspose2d, F.interpolate, skip concatenations, RAdam, bf16.
import torch, torch.nn as nn, torch.nn.functional as F
def block(i, o): return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.GroupNorm(8, o), nn.SiLU(), nn.Conv2d(o, o, 3, padding=1), nn.GroupNorm(8, o), nn.SiLU())
class UNet(nn.Module):
    def __init__(s, c=(64, 128, 256, 512)):
        super().__init__()
        s.down = nn.ModuleList([block(3, c[0])] + [block(c[i], c[i + 1]) for i in range(3)])
        s.up = nn.ModuleList(nn.ConvTranspose2d(c[i + 1], c[i], 2, stride=2) for i in reversed(range(3)))
        s.dec = nn.ModuleList(block(2 * c[i], c[i]) for i in reversed(range(3)))
        s.out = nn.Conv2d(c[0], 21, 1)
    def forward(s, x):
        skips = []
        for i, d in enumerate(s.down):
            x = d(x)
            if i < 3: skips.append(x); x = F.max_pool2d(x, 2)
        for u, d in zip(s.up, s.dec):
            x = d(torch.cat([u(x), skips.pop()], 1))
        return F.interpolate(s.out(x), scale_factor=2, mode="bilinear", align_corners=False)
model = UNet().cuda()
opt = torch.optim.RAdam(model.parameters(), lr=1e-3, decoupled_weight_decay=True, weight_decay=1e-2)
for step in range(5):
    img = torch.randn(8, 3, 256, 256, device="cuda")
    mask = torch.randint(0, 21, (8, 512, 512), device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        loss = F.cross_entropy(model(img), mask, ignore_index=255)
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    print(step, float(loss))
