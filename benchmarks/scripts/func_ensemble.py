# Model ensembling with torch.func, taken to training (the PyTorch "Model ensembling" tutorial:
# stack_module_state + vmap(functional_call) over a 'meta' base model). N MLPs are trained at once:
# their stacked parameters are leaf tensors optimised by one Adam, each model sees its own minibatch,
# bf16 autocast, gradient clipping over the whole ensemble.
import argparse
import copy
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, stack_module_state, vmap


class MLP(nn.Module):
    def __init__(self, in_dim=1024, hidden=2048, num_classes=1000, dropout=0.1):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden)
        self.norm1 = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, num_classes)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        x = self.dropout(F.gelu(self.norm1(self.fc1(x))))
        x = self.dropout(F.gelu(self.norm2(self.fc2(x))))
        return self.head(x)


def get_args():
    p = argparse.ArgumentParser(description="train an ensemble of MLPs with torch.func")
    p.add_argument("--num-models", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=2048, help="minibatch per model")
    p.add_argument("--in-dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--log-every", type=int, default=1)
    return p.parse_args()


def main():
    args = get_args()
    device = "cuda"
    torch.manual_seed(0)

    models = [MLP(args.in_dim, args.hidden, args.num_classes).to(device) for _ in range(args.num_models)]
    params, buffers = stack_module_state(models)
    for p in params.values():
        p.requires_grad_()

    # Construct a "stateless" version of one of the models. It is "stateless" in
    # the sense that the parameters are meta Tensors and do not have storage.
    base_model = copy.deepcopy(models[0])
    base_model = base_model.to("meta")

    def fmodel(params, buffers, x):
        return functional_call(base_model, (params, buffers), (x,))

    ensemble = vmap(fmodel, in_dims=(0, 0, 0), randomness="different")

    optimizer = torch.optim.Adam(params.values(), lr=args.lr)
    n_params = sum(p.numel() for p in params.values())
    print(f"{args.num_models} models, {n_params / 1e6:.1f}M parameters in total")

    for step in range(args.steps):
        t0 = time.time()
        # each model gets its own minibatch (synthetic data)
        x = torch.randn(args.num_models, args.batch_size, args.in_dim, device=device)
        y = torch.randint(0, args.num_classes, (args.num_models, args.batch_size), device=device)

        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = ensemble(params, buffers, x)                  # (N, B, C)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
            loss = loss.view(args.num_models, args.batch_size).mean(1)  # per-model loss
        loss.sum().backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params.values(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if step % args.log_every == 0:
            with torch.no_grad():
                acc = (logits.argmax(-1) == y).float().mean(1)
            print(f"step {step}: loss {loss.mean().item():.4f} (best {loss.min().item():.4f}) "
                  f"acc {acc.mean().item():.3f} grad_norm {grad_norm.item():.3f} "
                  f"{(time.time() - t0) * 1000:.0f} ms")

    # write the trained weights back into the individual models
    with torch.no_grad():
        for i, m in enumerate(models):
            for name, p in m.named_parameters():
                p.copy_(params[name][i])
    print(f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
          f"reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
