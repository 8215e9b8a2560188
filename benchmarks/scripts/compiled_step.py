# torch.compile on the model and on a function that steps a fused AdamW, with torch.inference_mode validation.
import torch, torch.nn as nn
model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to("cuda")
model = torch.compile(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
@torch.compile(fullgraph=False)
def opt_step():
    opt.step()
for i in range(5):
    x = torch.randn(256, 1024, device="cuda")
    loss = (model(x) - x).pow(2).mean()
    loss.backward()
    opt_step()
    opt.zero_grad(set_to_none=True)
    with torch.inference_mode():
        v = model(torch.randn(64, 1024, device="cuda")).sum()
    print(i, loss.item(), v.item())
