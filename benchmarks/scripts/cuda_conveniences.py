# A script that uses many torch.cuda conveniences, in the style of research code.
import argparse, time, math
import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
args = p.parse_args()

torch.backends.cudnn.benchmark = True
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
torch.cuda.manual_seed_all(0)
assert torch.cuda.is_available()
dev = torch.device("cuda", torch.cuda.current_device())
print(torch.cuda.get_device_name(dev), torch.cuda.get_device_capability(dev), torch.cuda.is_bf16_supported())
free, total = torch.cuda.mem_get_info()
print(f"free {free/2**30:.1f} of {total/2**30:.1f} GiB")

class Net(nn.Module):
    def __init__(s):
        super().__init__()
        s.conv = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
                               nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        s.fc = nn.Linear(128, 10)
    def forward(s, x):
        return s.fc(torch.flatten(s.conv(x), 1))

model = Net().to(dev, memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=args.steps)
scaler = torch.amp.GradScaler("cuda")
stream = torch.cuda.Stream()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
for step in range(args.steps):
    with torch.cuda.stream(stream):
        x = torch.randn(128, 3, 64, 64, pin_memory=True).to(dev, non_blocking=True).contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (128,), pin_memory=True).to(dev, non_blocking=True)
    torch.cuda.current_stream().wait_stream(stream)
    x.record_stream(torch.cuda.current_stream())
    start.record()
    torch.cuda.nvtx.range_push(f"step{step}")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    sched.step()
    torch.cuda.nvtx.range_pop()
    end.record()
    torch.cuda.synchronize()
    if not math.isfinite(loss.item()):
        raise SystemExit("nan")
    print(step, f"{loss.item():.3f}", f"{start.elapsed_time(end):.1f} ms", f"{torch.cuda.max_memory_allocated()/2**20:.0f} MiB",
          torch.cuda.memory_reserved() // 2**20, gn.item())
    torch.cuda.reset_peak_memory_stats()
print(torch.cuda.memory_summary(abbreviated=True)[:200])
