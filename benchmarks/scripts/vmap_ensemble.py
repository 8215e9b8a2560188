"""Model ensembling as in the PyTorch "Model ensembling" tutorial (torch.func), but trained: N small CNNs stacked with stack_module_state, run with functional_call under torch.vmap on the same minibatch (in_dims=(0, 0, None), randomness="different" for dropout), the stacked parameters made leaf tensors and given to one Adam, cross-entropy over every member, fp32."""
import argparse
import copy
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, stack_module_state


class SimpleCNN(nn.Module):
    def __init__(self, num_classes=10, width=32, dropout=0.25):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.conv3 = nn.Conv2d(2 * width, 4 * width, 3, padding=1)
        self.fc1 = nn.Linear(4 * width * 8 * 8, 256)
        self.fc2 = nn.Linear(256, num_classes)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # 32x32 -> 16x16
        x = F.max_pool2d(F.relu(self.conv3(x)), 2)  # 16x16 -> 8x8
        x = torch.flatten(x, 1)
        x = self.dropout(F.relu(self.fc1(x)))
        return self.fc2(x)


def get_args():
    parser = argparse.ArgumentParser(description="train an ensemble of CNNs at once with torch.func.vmap")
    parser.add_argument("--num-models", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--log-interval", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main():
    args = get_args()
    torch.manual_seed(args.seed)
    device = "cuda"

    num_models = args.num_models
    models = [SimpleCNN(width=args.width).to(device) for _ in range(num_models)]

    # stack each parameter of the N models along a new leading dimension
    params, buffers = stack_module_state(models)
    # the stacked tensors are what we optimise: make them leaves that require grad
    params = {k: v.detach().requires_grad_() for k, v in params.items()}

    # "stateless" copy of one model: its parameters live on the meta device and have no storage
    base_model = copy.deepcopy(models[0]).to("meta")

    def fmodel(params, buffers, x):
        return functional_call(base_model, (params, buffers), (x,))

    # every model sees the same minibatch; each member draws its own dropout mask
    ensemble = torch.vmap(fmodel, in_dims=(0, 0, None), randomness="different")

    optimizer = torch.optim.Adam(params.values(), lr=args.lr)
    n_params = sum(p.numel() for p in params.values())
    print(f"ensemble of {num_models} models, {n_params / 1e6:.2f}M parameters in total")

    # synthetic CIFAR-10-sized data
    def get_batch():
        x = torch.randn(args.batch_size, 3, 32, 32, device=device)
        y = torch.randint(0, 10, (args.batch_size,), device=device)
        return x, y

    t0 = time.time()
    for step in range(1, args.steps + 1):
        x, y = get_batch()
        logits = ensemble(params, buffers, x)  # (num_models, batch, 10)
        # cross-entropy over all members: (batch, classes, models) against (batch, models)
        loss = F.cross_entropy(logits.movedim(0, -1), y[:, None].expand(-1, num_models)) * num_models
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

        if step % args.log_interval == 0 or step == 1:
            with torch.no_grad():
                member_acc = (logits.argmax(-1) == y).float().mean(1)
                ensemble_acc = (logits.softmax(-1).mean(0).argmax(-1) == y).float().mean()
            elapsed = time.time() - t0
            print(f"step {step:4d} | loss {loss.item() / num_models:.4f} | member acc {member_acc.mean().item():.3f} "
                  f"| ensemble acc {ensemble_acc.item():.3f} | {elapsed * 1000 / step:.1f} ms/step")

    # evaluate the ensemble on a held-out (synthetic) batch
    with torch.no_grad():
        x, y = get_batch()
        base_model.eval()
        logits = ensemble(params, buffers, x)
        probs = logits.softmax(-1).mean(0)
        print(f"eval: ensemble acc {(probs.argmax(-1) == y).float().mean().item():.3f}")
    print(f"max memory allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
