#!/usr/bin/env python
"""Continuous-depth (ODE-Net) MNIST-style classifier trained with the adjoint method.

Imitates rtqichen/torchdiffeq: ``examples/odenet_mnist.py`` (the model, the
training loop and its helpers) and ``torchdiffeq/_impl/adjoint.py`` (the
``OdeintAdjointMethod`` autograd.Function), with the solver reduced to a
fixed-step RK4 so that every step costs the same.

Habits copied:
- ``norm()`` = ``nn.GroupNorm(min(32, dim), dim)``; ``ConcatConv2d`` that
  concatenates a constant ``t`` channel (``torch.ones_like(x[:, :1]) * t``);
  ``ODEfunc`` with three GroupNorms, two ConcatConv2d and an ``nfe`` counter
  incremented on every call; ``ODEBlock`` with ``integration_time =
  torch.tensor([0, 1]).float()`` moved with ``.type_as(x)`` in forward.
- the "conv" downsampling stem (conv 3x3, two strided ResBlock-free convs with
  norm+ReLU as in ``downsampling_method == 'conv'``), the FC head
  ``[norm, ReLU, AdaptiveAvgPool2d((1, 1)), Flatten, Linear]``.
- the adjoint written the way ``_impl/adjoint.py`` does it: forward integrates
  under ``torch.no_grad()`` and ``ctx.save_for_backward`` keeps only the
  solution at the final time (and t); backward builds the augmented state
  ``(y, adj_y, adj_params)`` and integrates it backwards in time, and at every
  solver stage runs ``torch.autograd.grad(func(t, y), (y, *params), -adj_y,
  allow_unused=True, retain_graph=True)`` inside ``torch.enable_grad()`` on a
  detached ``y.requires_grad_(True)`` -- an autograd graph built and consumed
  inside backward. Parameter gradients are flattened (``_flatten``) and
  accumulated into one vector, unflattened at the end, ``None`` replaced by
  zeros.
- ``RunningAverageMeter`` (momentum 0.99) for batch time / loss, ``nfe``
  forward / backward counters read and reset each iteration, SGD with momentum
  0.9, lr 0.1 scaled by ``batch_size / 128``, learning-rate set by hand each step
  (``learning_rate_with_decay``), ``nn.CrossEntropyLoss()`` on random 28x28
  images, batch 128, an accuracy evaluation at the end under ``torch.no_grad()``.

    python neural_ode_adjoint.py --steps 10
"""

import argparse
import time

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--batch_size", type=int, default=128)
parser.add_argument("--dim", type=int, default=64)
parser.add_argument("--rk_steps", type=int, default=4, help="fixed RK4 steps over [0, 1]")
parser.add_argument("--adjoint", type=eval, default=True, choices=[True, False])
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()

device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


# ----------------------------------------------------------------------------- solver
def _flatten(sequence):
    flat = [p.contiguous().view(-1) for p in sequence]
    return torch.cat(flat) if len(flat) > 0 else torch.tensor([])


def _flatten_convert_none_to_zeros(sequence, like_sequence):
    flat = [
        p.contiguous().view(-1) if p is not None else torch.zeros_like(q).view(-1)
        for p, q in zip(sequence, like_sequence)
    ]
    return torch.cat(flat) if len(flat) > 0 else torch.tensor([])


def rk4_step(func, t0, dt, y):
    """One classical RK4 step on a tuple state, as torchdiffeq's rk4_alt_step_func."""
    k1 = func(t0, y)
    k2 = func(t0 + dt / 3, tuple(y_ + dt * k1_ / 3 for y_, k1_ in zip(y, k1)))
    k3 = func(t0 + dt * 2 / 3, tuple(y_ + dt * (k1_ / -3 + k2_) for y_, k1_, k2_ in zip(y, k1, k2)))
    k4 = func(t0 + dt, tuple(y_ + dt * (k1_ - k2_ + k3_) for y_, k1_, k2_, k3_ in zip(y, k1, k2, k3)))
    return tuple(
        y_ + dt * (k1_ + 3 * (k2_ + k3_) + k4_) * 0.125
        for y_, k1_, k2_, k3_, k4_ in zip(y, k1, k2, k3, k4)
    )


def odeint_fixed(func, y0, t, n_steps):
    """Integrates a tuple state from t[0] to t[1] with n_steps RK4 steps; returns the final state."""
    t0, t1 = t[0], t[1]
    dt = (t1 - t0) / n_steps
    y = y0
    for i in range(n_steps):
        y = rk4_step(func, t0 + i * dt, dt, y)
    return y


class OdeintAdjointMethod(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *args):
        assert len(args) >= 5, "Internal error: all arguments required."
        y0, func, t, n_steps, flat_params = args[:-4], args[-4], args[-3], args[-2], args[-1]
        ctx.func, ctx.n_steps = func, n_steps

        with torch.no_grad():
            ans = odeint_fixed(lambda t_, y_: (func(t_, y_[0]),), y0, t, n_steps)
        ctx.save_for_backward(t, flat_params, *ans)
        return ans

    @staticmethod
    def backward(ctx, *grad_output):
        t, flat_params, *ans = ctx.saved_tensors
        ans = tuple(ans)
        func, n_steps = ctx.func, ctx.n_steps
        f_params = tuple(func.parameters())
        n_tensors = len(ans)

        def augmented_dynamics(t, y_aug):
            # Dynamics of the original system augmented with
            # the adjoint wrt y, and an integrator wrt t and args.
            y, adj_y = y_aug[:n_tensors], y_aug[n_tensors:2 * n_tensors]

            with torch.set_grad_enabled(True):
                t = t.to(y[0].device).detach().requires_grad_(True)
                y = tuple(y_.detach().requires_grad_(True) for y_ in y)
                func_eval = func(t, y[0])
                func_eval = (func_eval,)
                vjp_t, *vjp_y_and_params = torch.autograd.grad(
                    func_eval, (t,) + y + f_params,
                    tuple(-adj_y_ for adj_y_ in adj_y), allow_unused=True, retain_graph=True
                )
            vjp_y = vjp_y_and_params[:n_tensors]
            vjp_params = vjp_y_and_params[n_tensors:]

            # autograd.grad returns None if no gradient, set to zero.
            vjp_t = torch.zeros_like(t) if vjp_t is None else vjp_t
            vjp_y = tuple(torch.zeros_like(y_) if vjp_y_ is None else vjp_y_ for vjp_y_, y_ in zip(vjp_y, y))
            vjp_params = _flatten_convert_none_to_zeros(vjp_params, f_params)

            if len(f_params) == 0:
                vjp_params = torch.tensor(0.).to(vjp_y[0])
            return (*func_eval, *vjp_y, vjp_t, vjp_params)

        T = ans[0].shape[0]
        with torch.no_grad():
            adj_y = tuple(grad_output_[-1] if grad_output_.dim() == ans[0].dim() else grad_output_ for grad_output_ in grad_output)
            adj_params = torch.zeros_like(flat_params)
            adj_time = torch.tensor(0.).to(t)
            time_vjps = []

            ans_i = ans
            # Solve backwards in time: t[1] -> t[0].
            aug_y0 = (*ans_i, *grad_output, adj_time, adj_params)
            aug_ans = odeint_fixed(
                augmented_dynamics, aug_y0, torch.stack([t[1], t[0]]), n_steps
            )

            # Unpack aug_ans.
            adj_y = aug_ans[n_tensors:2 * n_tensors]
            adj_time = aug_ans[2 * n_tensors]
            adj_params = aug_ans[2 * n_tensors + 1]
            del aug_ans, T, time_vjps

        return (*adj_y, None, torch.stack([adj_time, adj_time]), None, adj_params)


def odeint_adjoint(func, y0, t, n_steps):
    if not isinstance(func, nn.Module):
        raise ValueError("func is required to be an instance of nn.Module.")
    flat_params = _flatten(func.parameters())
    ys = OdeintAdjointMethod.apply(y0, func, t, n_steps, flat_params)
    return ys[0]


def odeint(func, y0, t, n_steps):
    return odeint_fixed(lambda t_, y_: (func(t_, y_[0]),), (y0,), t, n_steps)[0]


# ----------------------------------------------------------------------------- model
def norm(dim):
    return nn.GroupNorm(min(32, dim), dim)


class ConcatConv2d(nn.Module):
    def __init__(self, dim_in, dim_out, ksize=3, stride=1, padding=0, dilation=1, groups=1, bias=True, transpose=False):
        super(ConcatConv2d, self).__init__()
        module = nn.ConvTranspose2d if transpose else nn.Conv2d
        self._layer = module(
            dim_in + 1, dim_out, kernel_size=ksize, stride=stride, padding=padding, dilation=dilation, groups=groups,
            bias=bias
        )

    def forward(self, t, x):
        tt = torch.ones_like(x[:, :1, :, :]) * t
        ttx = torch.cat([tt, x], 1)
        return self._layer(ttx)


class ODEfunc(nn.Module):
    def __init__(self, dim):
        super(ODEfunc, self).__init__()
        self.norm1 = norm(dim)
        self.relu = nn.ReLU(inplace=True)
        self.conv1 = ConcatConv2d(dim, dim, 3, 1, 1)
        self.norm2 = norm(dim)
        self.conv2 = ConcatConv2d(dim, dim, 3, 1, 1)
        self.norm3 = norm(dim)
        self.nfe = 0

    def forward(self, t, x):
        self.nfe += 1
        out = self.norm1(x)
        out = self.relu(out)
        out = self.conv1(t, out)
        out = self.norm2(out)
        out = self.relu(out)
        out = self.conv2(t, out)
        out = self.norm3(out)
        return out


class ODEBlock(nn.Module):
    def __init__(self, odefunc):
        super(ODEBlock, self).__init__()
        self.odefunc = odefunc
        self.integration_time = torch.tensor([0, 1]).float()

    def forward(self, x):
        self.integration_time = self.integration_time.type_as(x)
        if args.adjoint:
            out = odeint_adjoint(self.odefunc, x, self.integration_time, args.rk_steps)
        else:
            out = odeint(self.odefunc, x, self.integration_time, args.rk_steps)
        return out

    @property
    def nfe(self):
        return self.odefunc.nfe

    @nfe.setter
    def nfe(self, value):
        self.odefunc.nfe = value


class Flatten(nn.Module):
    def __init__(self):
        super(Flatten, self).__init__()

    def forward(self, x):
        shape = torch.prod(torch.tensor(x.shape[1:])).item()
        return x.view(-1, shape)


class RunningAverageMeter(object):
    """Computes and stores the average and current value"""

    def __init__(self, momentum=0.99):
        self.momentum = momentum
        self.reset()

    def reset(self):
        self.val = None
        self.avg = 0

    def update(self, val):
        if self.val is None:
            self.avg = val
        else:
            self.avg = self.avg * self.momentum + val * (1 - self.momentum)
        self.val = val


def learning_rate_with_decay(batch_size, batch_denom, batches_per_epoch, boundary_epochs, decay_rates):
    initial_learning_rate = args.lr * batch_size / batch_denom

    boundaries = [int(batches_per_epoch * epoch) for epoch in boundary_epochs]
    vals = [initial_learning_rate * decay for decay in decay_rates]

    def learning_rate_fn(itr):
        lt = [itr < b for b in boundaries] + [True]
        i = lt.index(True)
        return vals[i]

    return learning_rate_fn


def one_hot(x, K):
    return (x[:, None] == torch.arange(K)[None, :]).astype(int)


def random_batches(n_batches, batch_size):
    """Stand-in for the MNIST DataLoader: normalized 1x28x28 images and labels."""
    g = torch.Generator().manual_seed(0)
    while True:
        for _ in range(n_batches):
            x = torch.randn(batch_size, 1, 28, 28, generator=g)
            y = torch.randint(0, 10, (batch_size,), generator=g)
            yield x, y


def accuracy(model, batches, n):
    total_correct = 0
    for _ in range(n):
        x, y = next(batches)
        x = x.to(device)
        target_class = y.numpy()
        predicted_class = torch.argmax(model(x), dim=1).cpu().numpy()
        total_correct += (predicted_class == target_class).sum()
    return total_correct / (n * args.batch_size)


if __name__ == "__main__":
    torch.manual_seed(0)
    dim = args.dim
    downsampling_layers = [
        nn.Conv2d(1, dim, 3, 1),
        norm(dim),
        nn.ReLU(inplace=True),
        nn.Conv2d(dim, dim, 4, 2, 1),
        norm(dim),
        nn.ReLU(inplace=True),
        nn.Conv2d(dim, dim, 4, 2, 1),
    ]
    feature_layers = [ODEBlock(ODEfunc(dim))]
    fc_layers = [norm(dim), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d((1, 1)), Flatten(), nn.Linear(dim, 10)]

    model = nn.Sequential(*downsampling_layers, *feature_layers, *fc_layers).to(device)
    print("Number of parameters: {}".format(sum(p.numel() for p in model.parameters() if p.requires_grad)))

    criterion = nn.CrossEntropyLoss().to(device)
    batches_per_epoch = 469
    train_loader = random_batches(batches_per_epoch, args.batch_size)
    lr_fn = learning_rate_with_decay(
        args.batch_size, batch_denom=128, batches_per_epoch=batches_per_epoch, boundary_epochs=[60, 100, 140],
        decay_rates=[1, 0.1, 0.01, 0.001]
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    best_acc = 0
    batch_time_meter = RunningAverageMeter()
    f_nfe_meter = RunningAverageMeter()
    b_nfe_meter = RunningAverageMeter()
    end = time.time()

    for itr in range(args.steps):
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr_fn(itr)

        optimizer.zero_grad()
        x, y = next(train_loader)
        x = x.to(device)
        y = y.to(device)
        logits = model(x)
        loss = criterion(logits, y)

        nfe_forward = feature_layers[0].nfe
        feature_layers[0].nfe = 0

        loss.backward()
        optimizer.step()

        nfe_backward = feature_layers[0].nfe
        feature_layers[0].nfe = 0

        batch_time_meter.update(time.time() - end)
        f_nfe_meter.update(nfe_forward)
        b_nfe_meter.update(nfe_backward)
        end = time.time()

        print(
            "Iter {:04d} | Time {:.3f} ({:.3f}) | NFE-F {:.1f} | NFE-B {:.1f} | Loss {:.4f}".format(
                itr, batch_time_meter.val, batch_time_meter.avg, f_nfe_meter.avg, b_nfe_meter.avg, loss.item()
            )
        )

    with torch.no_grad():
        val_acc = accuracy(model, train_loader, 2)
    print("Val Acc {:.4f}".format(val_acc))
