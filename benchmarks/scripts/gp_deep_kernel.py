# Exact GP regression with deep kernel learning, in the style of GPyTorch's examples
# (examples/06_PyTorch_NN_Integration_DKL/KISSGP_Deep_Kernel_Regression_CUDA.ipynb,
# examples/01_Exact_GPs/Simple_GP_Regression.ipynb) but in plain torch, since GPyTorch is not
# installed: an MLP feature extractor (1000-500-50-2, as in the notebook) scaled to [-1, 1], a
# ConstantMean, ScaleKernel(RBFKernel) with softplus-constrained raw_lengthscale / raw_outputscale,
# a GaussianLikelihood with a softplus raw_noise (>= 1e-4), and ExactMarginalLogLikelihood as an
# nn.Module holding likelihood and model; the N x N train covariance, psd_safe_cholesky's
# cholesky_ex + jitter retry loop on torch.linalg.LinAlgError, cholesky_solve, logdet as
# 2 * L.diagonal().log().sum(), loss = -mll / N; Adam with one param group per submodule as in
# the notebook; `--double` for float64 (GPyTorch's usual advice for Cholesky); every
# `--eval-every` steps a prediction under model.eval() + torch.no_grad() with
# torch.linalg.solve_triangular (predictive mean and variance). Synthetic data, so it runs offline.
#
#     python gp_deep_kernel.py --n-train 2048 --n-test 512 --max-steps 20 --double
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class LargeFeatureExtractor(nn.Sequential):
    def __init__(self, data_dim, feat_dim=2):
        super(LargeFeatureExtractor, self).__init__()
        self.add_module('linear1', nn.Linear(data_dim, 1000))
        self.add_module('relu1', nn.ReLU())
        self.add_module('linear2', nn.Linear(1000, 500))
        self.add_module('relu2', nn.ReLU())
        self.add_module('linear3', nn.Linear(500, 50))
        self.add_module('relu3', nn.ReLU())
        self.add_module('linear4', nn.Linear(50, feat_dim))


class ScaleToBounds(nn.Module):
    """gpytorch.utils.grid.ScaleToBounds: min/max from the training batch, frozen in eval."""

    def __init__(self, lower_bound=-1.0, upper_bound=1.0):
        super().__init__()
        self.lower_bound, self.upper_bound = lower_bound, upper_bound
        self.register_buffer("min_val", torch.tensor(lower_bound))
        self.register_buffer("max_val", torch.tensor(upper_bound))

    def forward(self, x):
        if self.training:
            min_val = x.min()
            max_val = x.max()
            self.min_val.data = min_val.detach()
            self.max_val.data = max_val.detach()
        else:
            min_val, max_val = self.min_val, self.max_val
        diff = max_val - min_val
        x = (x - min_val) * (0.95 * (self.upper_bound - self.lower_bound) / diff) + 0.95 * self.lower_bound
        return x


class ConstantMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.constant = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return self.constant.expand(x.shape[:-1])


def sq_dist(x1, x2):
    # gpytorch.kernels.kernel.sq_dist: one matmul of padded inputs, clamped at 0
    adjustment = x1.mean(-2, keepdim=True)
    x1 = x1 - adjustment
    x2 = x2 - adjustment
    x1_norm = x1.pow(2).sum(dim=-1, keepdim=True)
    x1_pad = torch.ones_like(x1_norm)
    x2_norm = x2.pow(2).sum(dim=-1, keepdim=True)
    x2_pad = torch.ones_like(x2_norm)
    x1_ = torch.cat([-2.0 * x1, x1_norm, x1_pad], dim=-1)
    x2_ = torch.cat([x2, x2_pad, x2_norm], dim=-1)
    res = x1_.matmul(x2_.transpose(-2, -1))
    res.clamp_min_(0)
    return res


class RBFKernel(nn.Module):
    def __init__(self):
        super().__init__()
        self.raw_lengthscale = nn.Parameter(torch.zeros(1, 1))

    @property
    def lengthscale(self):
        return F.softplus(self.raw_lengthscale)

    def forward(self, x1, x2, diag=False):
        ls = self.lengthscale
        x1_ = x1.div(ls)
        x2_ = x2.div(ls)
        if diag:
            return torch.ones(x1.shape[:-1], dtype=x1.dtype, device=x1.device)
        return sq_dist(x1_, x2_).div_(-2).exp_()


class ScaleKernel(nn.Module):
    def __init__(self, base_kernel):
        super().__init__()
        self.base_kernel = base_kernel
        self.raw_outputscale = nn.Parameter(torch.tensor(0.0))

    @property
    def outputscale(self):
        return F.softplus(self.raw_outputscale)

    def forward(self, x1, x2, diag=False):
        return self.base_kernel(x1, x2, diag=diag).mul(self.outputscale)


class GaussianLikelihood(nn.Module):
    def __init__(self, noise_lower_bound=1e-4):
        super().__init__()
        self.raw_noise = nn.Parameter(torch.zeros(1))
        self.noise_lower_bound = noise_lower_bound

    @property
    def noise(self):
        return F.softplus(self.raw_noise) + self.noise_lower_bound

    def forward(self, mean, covar):
        # likelihood(model(x)): the marginal adds the noise on the diagonal
        n = covar.shape[-1]
        eye = torch.eye(n, dtype=covar.dtype, device=covar.device)
        return mean, covar + self.noise * eye


def psd_safe_cholesky(A, upper=False, jitter=None, max_tries=None):
    """gpytorch.utils.cholesky.psd_safe_cholesky (linear_operator's _psd_safe_cholesky)."""
    L, info = torch.linalg.cholesky_ex(A, upper=upper)
    if not torch.any(info):
        return L
    if torch.any(torch.isnan(A)):
        raise ValueError("cholesky_cpu: NaNs in A")
    if jitter is None:
        jitter = 1e-6 if A.dtype == torch.float32 else 1e-8
    if max_tries is None:
        max_tries = 3
    Aprime = A.clone()
    jitter_prev = 0
    for i in range(max_tries):
        jitter_new = jitter * (10 ** i)
        Aprime.diagonal(dim1=-2, dim2=-1).add_(jitter_new - jitter_prev)
        jitter_prev = jitter_new
        try:
            L = torch.linalg.cholesky(Aprime, upper=upper)
            print(f"A not p.d., added jitter of {jitter_new:.1e} to the diagonal")
            return L
        except torch.linalg.LinAlgError:
            continue
    raise torch.linalg.LinAlgError(f"Matrix not positive definite after repeatedly adding jitter up to {jitter_new:.1e}.")


class DKLModel(nn.Module):
    """gpytorch.models.ExactGP with a deep kernel: train data kept on the model."""

    def __init__(self, train_x, train_y, likelihood, data_dim):
        super().__init__()
        self.train_inputs = (train_x,)
        self.train_targets = train_y
        self.likelihood = likelihood
        self.mean_module = ConstantMean()
        self.covar_module = ScaleKernel(RBFKernel())
        self.feature_extractor = LargeFeatureExtractor(data_dim)
        self.scale_to_bounds = ScaleToBounds(-1.0, 1.0)
        self.prediction_cache = None

    def project(self, x):
        return self.scale_to_bounds(self.feature_extractor(x))

    def forward(self, x):
        if self.training:
            self.prediction_cache = None
            projected_x = self.project(x)
            return self.mean_module(projected_x), self.covar_module(projected_x, projected_x)
        # eval: exact predictive posterior given the training data (DefaultPredictionStrategy)
        train_x, = self.train_inputs
        full = torch.cat([train_x, x], dim=0)
        projected = self.project(full)
        n = train_x.shape[0]
        proj_train, proj_test = projected[:n], projected[n:]
        if self.prediction_cache is None:
            mean_train = self.mean_module(proj_train)
            _, k_train = self.likelihood(mean_train, self.covar_module(proj_train, proj_train))
            L = psd_safe_cholesky(k_train)
            alpha = torch.cholesky_solve((self.train_targets - mean_train).unsqueeze(-1), L)
            self.prediction_cache = (L, alpha)
        L, alpha = self.prediction_cache
        k_test_train = self.covar_module(proj_test, proj_train)
        pred_mean = self.mean_module(proj_test) + k_test_train.matmul(alpha).squeeze(-1)
        v = torch.linalg.solve_triangular(L, k_test_train.transpose(-2, -1), upper=False)
        pred_var = self.covar_module(proj_test, proj_test, diag=True) - v.pow(2).sum(dim=-2)
        return pred_mean, pred_var.clamp_min(1e-10)


class ExactMarginalLogLikelihood(nn.Module):
    def __init__(self, likelihood, model):
        super().__init__()
        self.likelihood = likelihood
        self.model = model

    def forward(self, function_dist, target):
        mean, covar = self.likelihood(*function_dist)
        n = target.shape[-1]
        L = psd_safe_cholesky(covar)
        diff = (target - mean).unsqueeze(-1)
        alpha = torch.cholesky_solve(diff, L)
        inv_quad = diff.mul(alpha).sum()
        logdet = 2 * L.diagonal(dim1=-2, dim2=-1).log().sum()
        res = -0.5 * (inv_quad + logdet + n * math.log(2 * math.pi))
        return res.div_(n)


def make_data(n, w, device, dtype, generator):
    data_dim = w.shape[0]
    x = torch.rand(n, data_dim, generator=generator) * 2 - 1
    y = torch.sin(3 * x @ w / math.sqrt(data_dim)) + 0.1 * torch.randn(n, generator=generator)
    return x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n-train", type=int, default=2048)
    parser.add_argument("--n-test", type=int, default=512)
    parser.add_argument("--data-dim", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--training-iterations", type=int, default=60)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--double", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float64 if args.double else torch.float32
    g = torch.Generator().manual_seed(args.seed)
    w = torch.randn(args.data_dim, generator=g)
    train_x, train_y = make_data(args.n_train, w, device, dtype, g)
    test_x, test_y = make_data(args.n_test, w, device, dtype, g)

    likelihood = GaussianLikelihood()
    model = DKLModel(train_x, train_y, likelihood, data_dim=args.data_dim)
    if torch.cuda.is_available():
        model = model.cuda()
        likelihood = likelihood.cuda()
    if args.double:
        model = model.double()
        likelihood = likelihood.double()

    model.train()
    likelihood.train()
    optimizer = torch.optim.Adam([
        {'params': model.feature_extractor.parameters()},
        {'params': model.covar_module.parameters()},
        {'params': model.mean_module.parameters()},
        {'params': model.likelihood.parameters()},
    ], lr=args.lr)
    mll = ExactMarginalLogLikelihood(likelihood, model)

    n_iter = args.training_iterations if args.max_steps is None else min(args.training_iterations, args.max_steps)
    start = time.time()
    for i in range(n_iter):
        model.train()
        likelihood.train()
        optimizer.zero_grad()
        output = model(train_x)
        loss = -mll(output, train_y)
        loss.backward()
        optimizer.step()
        msg = (f"Iter {i + 1}/{n_iter} - Loss: {loss.item():.3f} "
               f"lengthscale: {model.covar_module.base_kernel.lengthscale.item():.3f} "
               f"noise: {likelihood.noise.item():.4f}")
        if args.eval_every and (i + 1) % args.eval_every == 0:
            model.eval()
            likelihood.eval()
            with torch.no_grad():
                pred_mean, pred_var = model(test_x)
                rmse = (pred_mean - test_y).pow(2).mean().sqrt()
            msg += f" test RMSE: {rmse.item():.3f} mean var: {pred_var.mean().item():.4f}"
        print(msg + f" ({time.time() - start:.1f}s)")

    if torch.cuda.is_available():
        print(f"max memory allocated: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
