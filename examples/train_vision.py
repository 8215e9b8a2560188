"""Image classification with a torchvision model: a plain training loop.

    python examples/train_vision.py --steps 3
"""

import argparse
import time

import torch
import torch.nn.functional as F
import torchvision


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    model = getattr(torchvision.models, args.model)(num_classes=10).to(args.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(args.steps):
        # Random images stand in for a dataset (nothing to download).
        x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=args.device)
        y = torch.randint(0, 10, (args.batch_size,), device=args.device)
        t = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f}, {1e3 * (time.perf_counter() - t):.0f} ms")


if __name__ == "__main__":
    main()
