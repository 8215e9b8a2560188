# Physics-informed neural network for the viscous Burgers equation
#     u_t + u u_x - (0.01 / pi) u_xx = 0,  x in [-1, 1], t in [0, 1],
#     u(0, x) = -sin(pi x),  u(t, -1) = u(t, 1) = 0
# in the style of maziarraissi/PINNs (continuous_time_inference (Burgers)) ported to PyTorch:
# an MLP of tanh layers, collocation points with requires_grad=True, u_t / u_x / u_xx from
# torch.autograd.grad(..., create_graph=True), Adam first and then L-BFGS with a closure.
import argparse
import math
import time
from collections import OrderedDict

import torch
import torch.nn as nn


class DNN(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.depth = len(layers) - 1
        modules = []
        for i in range(self.depth - 1):
            modules.append((f"layer_{i}", nn.Linear(layers[i], layers[i + 1])))
            modules.append((f"activation_{i}", nn.Tanh()))
        modules.append((f"layer_{self.depth - 1}", nn.Linear(layers[-2], layers[-1])))
        self.layers = nn.Sequential(OrderedDict(modules))
        for m in self.layers:
            if isinstance(m, nn.Linear):
                nn.init.xavier_normal_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        return self.layers(x)


class PhysicsInformedNN:
    def __init__(self, X_u, u, X_f, layers, lb, ub, nu, device):
        self.device = device
        self.lb = torch.tensor(lb, dtype=torch.float32, device=device)
        self.ub = torch.tensor(ub, dtype=torch.float32, device=device)
        self.x_u = X_u[:, 0:1].clone().to(device)
        self.t_u = X_u[:, 1:2].clone().to(device)
        self.x_f = X_f[:, 0:1].clone().to(device).requires_grad_(True)
        self.t_f = X_f[:, 1:2].clone().to(device).requires_grad_(True)
        self.u = u.to(device)
        self.nu = nu
        self.dnn = DNN(layers).to(device)
        self.iter = 0

    def net_u(self, x, t):
        X = torch.cat([x, t], dim=1)
        H = 2.0 * (X - self.lb) / (self.ub - self.lb) - 1.0
        return self.dnn(H)

    def net_f(self, x, t):
        u = self.net_u(x, t)
        u_t = torch.autograd.grad(u, t, grad_outputs=torch.ones_like(u),
                                  retain_graph=True, create_graph=True)[0]
        u_x = torch.autograd.grad(u, x, grad_outputs=torch.ones_like(u),
                                  retain_graph=True, create_graph=True)[0]
        u_xx = torch.autograd.grad(u_x, x, grad_outputs=torch.ones_like(u_x),
                                   retain_graph=True, create_graph=True)[0]
        return u_t + u * u_x - self.nu * u_xx

    def loss_func(self):
        u_pred = self.net_u(self.x_u, self.t_u)
        f_pred = self.net_f(self.x_f, self.t_f)
        loss_u = torch.mean((self.u - u_pred) ** 2)
        loss_f = torch.mean(f_pred ** 2)
        return loss_u + loss_f, loss_u, loss_f

    def train_adam(self, n_iter, lr):
        optimizer = torch.optim.Adam(self.dnn.parameters(), lr=lr)
        self.dnn.train()
        for it in range(n_iter):
            t0 = time.perf_counter()
            optimizer.zero_grad()
            loss, loss_u, loss_f = self.loss_func()
            loss.backward()
            optimizer.step()
            torch.cuda.synchronize()
            print(f"Adam it {it}: loss {loss.item():.3e} loss_u {loss_u.item():.3e} "
                  f"loss_f {loss_f.item():.3e} {time.perf_counter() - t0:.3f}s "
                  f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")

    def train_lbfgs(self, n_steps, max_iter):
        optimizer = torch.optim.LBFGS(
            self.dnn.parameters(), lr=1.0, max_iter=max_iter, max_eval=int(max_iter * 1.25),
            history_size=50, tolerance_grad=1e-5, tolerance_change=1.0 * torch.finfo(torch.float32).eps,
            line_search_fn="strong_wolfe",
        )

        def closure():
            optimizer.zero_grad()
            loss, loss_u, loss_f = self.loss_func()
            loss.backward()
            self.iter += 1
            if self.iter % 5 == 0:
                print(f"LBFGS closure {self.iter}: loss {loss.item():.3e} "
                      f"loss_u {loss_u.item():.3e} loss_f {loss_f.item():.3e}")
            return loss

        for step in range(n_steps):
            loss = optimizer.step(closure)
            print(f"LBFGS step {step}: loss {loss.item():.3e} "
                  f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


def make_data(n_u, n_f, lb, ub, generator):
    # initial condition u(0, x) = -sin(pi x) and boundaries u(t, +-1) = 0
    x0 = torch.rand(n_u // 2, 1, generator=generator) * 2 - 1
    X0 = torch.cat([x0, torch.zeros_like(x0)], dim=1)
    u0 = -torch.sin(math.pi * x0)
    tb = torch.rand(n_u - n_u // 2, 1, generator=generator)
    xb = torch.where(torch.rand(tb.shape, generator=generator) < 0.5, -1.0, 1.0)
    Xb = torch.cat([xb, tb], dim=1)
    ub_vals = torch.zeros_like(tb)
    X_u = torch.cat([X0, Xb], dim=0)
    u = torch.cat([u0, ub_vals], dim=0)
    # collocation points: uniform in the domain (the original uses a Latin hypercube)
    lb_t, ub_t = torch.tensor(lb), torch.tensor(ub)
    X_f = lb_t + (ub_t - lb_t) * torch.rand(n_f, 2, generator=generator)
    X_f = torch.cat([X_f, X_u], dim=0)
    return X_u, u, X_f


def main():
    parser = argparse.ArgumentParser(description="PINN for Burgers' equation")
    parser.add_argument("--n-u", type=int, default=2000, help="initial/boundary points")
    parser.add_argument("--n-f", type=int, default=200_000, help="collocation points")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=8, help="hidden tanh layers")
    parser.add_argument("--adam-iters", type=int, default=3)
    parser.add_argument("--adam-lr", type=float, default=1e-3)
    parser.add_argument("--lbfgs-steps", type=int, default=4)
    parser.add_argument("--lbfgs-max-iter", type=int, default=4)
    args = parser.parse_args()

    device = torch.device("cuda")
    torch.manual_seed(1234)
    g = torch.Generator().manual_seed(1234)
    nu = 0.01 / math.pi
    lb, ub = [-1.0, 0.0], [1.0, 1.0]
    layers = [2] + [args.width] * args.depth + [1]

    X_u, u, X_f = make_data(args.n_u, args.n_f, lb, ub, g)
    model = PhysicsInformedNN(X_u, u, X_f, layers, lb, ub, nu, device)
    n_params = sum(p.numel() for p in model.dnn.parameters())
    print(f"{n_params / 1e6:.2f}M params, {X_f.shape[0]} collocation points")

    torch.cuda.reset_peak_memory_stats()
    model.train_adam(args.adam_iters, args.adam_lr)
    model.train_lbfgs(args.lbfgs_steps, args.lbfgs_max_iter)
    print(f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
          f"reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
