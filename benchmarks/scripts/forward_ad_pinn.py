"""Physics-informed network (2-D Poisson) with torch.func jacrev/hessian residuals and a forward-mode AD (fwAD dual numbers) loss, as in the PyTorch forward-mode AD / torch.func tutorials."""

import argparse
import math
import time

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn
from torch.func import functional_call, hessian, jacrev, vmap


class MLP(nn.Module):
    def __init__(self, in_dim=2, width=256, depth=6, out_dim=1):
        super().__init__()
        layers = [nn.Linear(in_dim, width), nn.Tanh()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.Tanh()]
        layers.append(nn.Linear(width, out_dim))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def source_term(xy):
    # u*(x, y) = sin(pi x) sin(pi y)  =>  -lap u* = 2 pi^2 sin(pi x) sin(pi y)
    x, y = xy[..., 0], xy[..., 1]
    return 2 * math.pi ** 2 * torch.sin(math.pi * x) * torch.sin(math.pi * y)


def exact(xy):
    return torch.sin(math.pi * xy[..., 0]) * torch.sin(math.pi * xy[..., 1])


def sample_interior(n, device):
    return torch.rand(n, 2, device=device)


def sample_boundary(n, device):
    t = torch.rand(n, device=device)
    side = torch.randint(0, 4, (n,), device=device)
    x = torch.where(side == 0, torch.zeros_like(t), torch.where(side == 1, torch.ones_like(t), t))
    y = torch.where(side == 2, torch.zeros_like(t), torch.where(side == 3, torch.ones_like(t), t))
    return torch.stack([x, y], dim=-1)


def main():
    parser = argparse.ArgumentParser(description="PINN for the 2-D Poisson equation")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--n-collocation", type=int, default=65536)
    parser.add_argument("--n-boundary", type=int, default=8192)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--fwad-weight", type=float, default=0.1)
    parser.add_argument("--log-interval", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = "cuda"

    model = MLP(2, args.width, args.depth, 1).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    print(f"model parameters: {sum(p.numel() for p in model.parameters()):,}")

    def u_single(params, xy):
        # xy: (2,) -> scalar
        return functional_call(model, params, (xy.unsqueeze(0),)).squeeze()

    for step in range(1, args.steps + 1):
        t0 = time.time()
        params = dict(model.named_parameters())
        xy = sample_interior(args.n_collocation, device)
        xb = sample_boundary(args.n_boundary, device)

        # PDE residual: -lap u - f = 0, second derivatives via torch.func
        hess = vmap(hessian(u_single, argnums=1), in_dims=(None, 0))(params, xy)  # (N, 2, 2)
        lap = hess.diagonal(dim1=-2, dim2=-1).sum(-1)
        residual = -lap - source_term(xy)
        loss_pde = residual.pow(2).mean()

        # gradient matching with jacrev: du/dxy should equal the exact solution's gradient
        x, y = xy[:, 0], xy[:, 1]
        du_dx = math.pi * torch.cos(math.pi * x) * torch.sin(math.pi * y)
        du_dy = math.pi * torch.sin(math.pi * x) * torch.cos(math.pi * y)
        grads = vmap(jacrev(u_single, argnums=1), in_dims=(None, 0))(params, xy)  # (N, 2)
        loss_grad = (grads - torch.stack([du_dx, du_dy], dim=-1)).pow(2).sum(-1).mean()

        # boundary condition u = 0
        loss_bc = model(xb).pow(2).mean()

        # directional derivative along a random tangent with forward-mode AD
        tangent = torch.randn_like(xy)
        tangent = tangent / tangent.norm(dim=-1, keepdim=True)
        with fwAD.dual_level():
            dual_in = fwAD.make_dual(xy, tangent)
            dual_out = model(dual_in)
            jvp = fwAD.unpack_dual(dual_out).tangent.squeeze(-1)
        # exact directional derivative of u*
        jvp_ref = du_dx * tangent[:, 0] + du_dy * tangent[:, 1]
        loss_fwad = (jvp - jvp_ref).pow(2).mean()

        loss = loss_pde + 10.0 * loss_bc + args.fwad_weight * loss_fwad + 0.1 * loss_grad
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

        if step % args.log_interval == 0:
            with torch.no_grad():
                err = (model(xy).squeeze(-1) - exact(xy)).abs().max().item()
            print(f"step {step:4d} | loss {loss.item():.4e} | pde {loss_pde.item():.3e} | "
                  f"bc {loss_bc.item():.3e} | fwad {loss_fwad.item():.3e} | max err {err:.3e} | "
                  f"{(time.time() - t0) * 1000:.0f} ms")

    print(f"peak memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
