# DP-SGD by hand with torch.func (the torch.func per-sample-gradients tutorial /
# opacus "functorch" mode): functional_call + vmap(grad(...)) for per-sample grads,
# per-sample clipping, Gaussian noise, grads written into p.grad, SGD w/ momentum.
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

BATCH, STEPS, MAX_GRAD_NORM, NOISE_MULT, LR = 512, 8, 1.0, 1.1, 0.25


class ConvNet(nn.Module):
    # GroupNorm instead of BatchNorm: BN mixes samples and is not DP-compatible.
    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.GroupNorm(16, 128), nn.ReLU(),
            nn.Conv2d(128, 128, 3, padding=1), nn.GroupNorm(16, 128), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(128, 256, 3, padding=1), nn.GroupNorm(32, 256), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


def main():
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = ConvNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)

    def compute_loss(params, buffers, sample, target):
        batch = sample.unsqueeze(0)
        targets = target.unsqueeze(0)
        predictions = functional_call(model, (params, buffers), (batch,))
        return F.cross_entropy(predictions, targets)

    per_sample_grads_fn = vmap(grad(compute_loss), in_dims=(None, None, 0, 0))

    # a fake CIFAR-10 on the device
    data = torch.randn(BATCH * STEPS, 3, 32, 32, device=device)
    labels = torch.randint(0, 10, (BATCH * STEPS,), device=device)

    for step in range(STEPS):
        x = data[step * BATCH:(step + 1) * BATCH]
        y = labels[step * BATCH:(step + 1) * BATCH]
        params = {k: v.detach() for k, v in model.named_parameters()}
        buffers = {k: v.detach() for k, v in model.named_buffers()}
        per_sample_grads = per_sample_grads_fn(params, buffers, x, y)

        # per-sample clipping to MAX_GRAD_NORM (flat L2 over all parameters)
        norms = torch.stack([g.reshape(g.shape[0], -1).norm(2, dim=1) for g in per_sample_grads.values()], dim=1)
        per_sample_norm = norms.norm(2, dim=1)
        clip_factor = (MAX_GRAD_NORM / (per_sample_norm + 1e-6)).clamp(max=1.0)

        for name, p in model.named_parameters():
            g = torch.einsum("i,i...->...", clip_factor, per_sample_grads[name])
            g = g + torch.randn_like(g) * NOISE_MULT * MAX_GRAD_NORM
            p.grad = g / BATCH
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        with torch.no_grad():
            loss = F.cross_entropy(model(x), y)
        print(f"step {step}: loss {loss.item():.4f} mean per-sample norm {per_sample_norm.mean().item():.3f} "
              f"clipped {(per_sample_norm > MAX_GRAD_NORM).float().mean().item() * 100:.0f}%")
    if device.type == "cuda":
        print(f"peak allocated {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
