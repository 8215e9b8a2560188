"""Contractive autoencoder (Rifai et al. 2011) the torch.func way, as in the "Jacobians, Hessians, hvp, vhp" / per-sample-grads tutorials and CAE / Jacobian-regularisation repos: loss = MSE reconstruction + lambda * ||dz/dx||_F^2, the per-sample encoder Jacobian from torch.func.vmap(torch.func.jacrev(encode, argnums=1, has_aux=True)) over torch.func.functional_call(encoder, dict(encoder.named_parameters()), ...), AdamW with no decay on biases/norms, cosine LR with warmup, optional bf16 autocast, torch.nn.utils.clip_grad_norm_.

Data is a synthetic low-dimensional manifold pushed into pixel space (flattened
64x64 RGB "images"), so nothing is downloaded.

    python contractive_ae_func.py --batch-size 128 --contractive-weight 1e-3 --bf16
"""
import argparse
import math
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, jacrev, vmap


def get_args():
    parser = argparse.ArgumentParser(description="Contractive autoencoder with torch.func")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--input-dim", type=int, default=3 * 64 * 64)
    parser.add_argument("--hidden-dim", type=int, default=2048)
    parser.add_argument("--latent-dim", type=int, default=256)
    parser.add_argument("--manifold-dim", type=int, default=16, help="intrinsic dim of the fake data")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--contractive-weight", type=float, default=1e-3, help="lambda")
    parser.add_argument("--clip-grad", type=float, default=1.0)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast")
    parser.add_argument("--log-interval", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class Encoder(nn.Module):
    def __init__(self, input_dim, hidden_dim, latent_dim):
        super().__init__()
        self.fc1 = nn.Linear(input_dim, hidden_dim)
        self.norm1 = nn.LayerNorm(hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, hidden_dim // 2)
        self.fc3 = nn.Linear(hidden_dim // 2, latent_dim)

    def forward(self, x):
        h = F.softplus(self.norm1(self.fc1(x)))
        h = F.softplus(self.fc2(h))
        return torch.sigmoid(self.fc3(h))


class Decoder(nn.Module):
    def __init__(self, latent_dim, hidden_dim, output_dim):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(latent_dim, hidden_dim // 2),
            nn.SiLU(),
            nn.Linear(hidden_dim // 2, hidden_dim),
            nn.SiLU(),
            nn.Linear(hidden_dim, output_dim),
        )

    def forward(self, z):
        return self.net(z)


class ContractiveAutoencoder(nn.Module):
    def __init__(self, input_dim, hidden_dim, latent_dim):
        super().__init__()
        self.encoder = Encoder(input_dim, hidden_dim, latent_dim)
        self.decoder = Decoder(latent_dim, hidden_dim, input_dim)

    def encode_and_jacobian(self, x):
        """Returns z (B, latent) and J = dz/dx (B, latent, input) for every sample."""
        params = dict(self.encoder.named_parameters())
        buffers = dict(self.encoder.named_buffers())

        def encode(p, xi):
            # xi is a single sample (input_dim,); vmap adds the batch back
            z = functional_call(self.encoder, (p, buffers), (xi,))
            return z, z  # (output to differentiate, aux)

        jac, z = vmap(jacrev(encode, argnums=1, has_aux=True), in_dims=(None, 0))(params, x)
        return z, jac

    def forward(self, x):
        z, jac = self.encode_and_jacobian(x)
        x_hat = self.decoder(z)
        return x_hat, z, jac


def contractive_loss(x, x_hat, jac, lam):
    recon = F.mse_loss(x_hat, x, reduction="mean")
    # squared Frobenius norm of the encoder Jacobian, averaged over the batch
    penalty = jac.float().pow(2).sum(dim=(1, 2)).mean()
    return recon + lam * penalty, recon, penalty


class ManifoldData:
    """x = sigmoid(A @ tanh(B @ u)) + noise, u ~ N(0, I_k): a k-dim manifold in pixel space."""

    def __init__(self, input_dim, manifold_dim, device, seed=0):
        rng = np.random.default_rng(seed)
        a = rng.standard_normal((input_dim, 4 * manifold_dim)).astype(np.float32) / math.sqrt(4 * manifold_dim)
        b = rng.standard_normal((4 * manifold_dim, manifold_dim)).astype(np.float32) / math.sqrt(manifold_dim)
        self.A = torch.from_numpy(a).to(device)
        self.B = torch.from_numpy(b).to(device)
        self.manifold_dim = manifold_dim
        self.device = device

    @torch.no_grad()
    def sample(self, batch_size):
        u = torch.randn(batch_size, self.manifold_dim, device=self.device)
        x = torch.sigmoid(torch.tanh(u @ self.B.T) @ self.A.T)
        return x + 0.01 * torch.randn_like(x)


def param_groups(model, weight_decay):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or "norm" in name or name.endswith(".bias"):
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def main():
    args = get_args()
    torch.manual_seed(args.seed)
    device = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True

    model = ContractiveAutoencoder(args.input_dim, args.hidden_dim, args.latent_dim).to(device)
    print(f"params: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))

    def lr_lambda(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    data = ManifoldData(args.input_dim, args.manifold_dim, device, seed=args.seed)

    model.train()
    t0 = time.time()
    for step in range(args.steps):
        x = data.sample(args.batch_size)

        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=args.bf16):
            x_hat, z, jac = model(x)
            loss, recon, penalty = contractive_loss(x, x_hat.float(), jac, args.contractive_weight)

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        optimizer.step()
        scheduler.step()

        if step % args.log_interval == 0:
            torch.cuda.synchronize()
            elapsed = time.time() - t0
            print(
                f"step {step:5d} | loss {loss.item():.5f} | recon {recon.item():.5f} | "
                f"||J||_F^2 {penalty.item():.3f} | grad norm {grad_norm.item():.3f} | "
                f"lr {scheduler.get_last_lr()[0]:.2e} | {elapsed:.1f}s"
            )

    with torch.no_grad():
        x = data.sample(args.batch_size)
        x_hat = model.decoder(model.encoder(x))
        print(f"final eval recon mse {F.mse_loss(x_hat, x).item():.5f}")
    print(f"max memory allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
