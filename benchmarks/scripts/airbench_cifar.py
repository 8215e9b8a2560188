# KellerJordan/cifar10-airbench (airbench94) / hlb-CIFAR10 habit: the whole training and test set
# held on the GPU (synthetic uint8 CIFAR-sized images -> normalised fp16, channels_last), a GPU-side
# loader (reflect padding once, random crops by a loop over the few offsets with boolean masks,
# flips every other epoch by pre-flipping half the images), a small VGG-ish net whose weights are
# .half() with its BatchNorms kept in float, a first 2x2 conv frozen to patch-whitening weights
# (torch.linalg.eigh of the patches' covariance on the GPU, under no_grad), SGD nesterov with two
# param groups (BN biases: their own lr, no weight decay), label-smoothed cross entropy with
# reduction="none" then .sum(), an lr set by hand every step, a lookahead EMA of the state_dict
# every 5 steps, and a flip-TTA evaluation under no_grad at the end. No autocast.
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=10)
p.add_argument("--train_images", type=int, default=10000)
p.add_argument("--test_images", type=int, default=2000)
p.add_argument("--batch_size", type=int, default=1024)
p.add_argument("--widths", type=int, nargs=3, default=[64, 256, 256])
p.add_argument("--device", default="cuda")
args = p.parse_args()

device = args.device  # "cuda", as in airbench (torch.device(gpu) / .cuda())
torch.backends.cudnn.benchmark = True

hyp = {
    "opt": {"lr": 11.5, "momentum": 0.85, "weight_decay": 0.0153, "bias_scaler": 64.0,
            "label_smoothing": 0.2, "whiten_bias_epochs": 3, "train_epochs": 9.9},
    "aug": {"flip": True, "translate": 2},
    "net": {"batchnorm_momentum": 0.6, "scaling_factor": 1 / 9, "tta_level": 1},
}

CIFAR_MEAN = torch.tensor((0.4914, 0.4822, 0.4465))
CIFAR_STD = torch.tensor((0.2470, 0.2435, 0.2616))


# ---------------------------------------------------------------- data: all of it on the GPU
def make_fake_cifar(n, seed):
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=g)  # as torchvision's .data (NHWC)
    labels = torch.randint(0, 10, (n,), generator=g)
    return {"images": images, "labels": labels, "classes": list(range(10))}


def batch_flip_lr(inputs):
    flip_mask = (torch.rand(len(inputs), device=inputs.device) < 0.5).view(-1, 1, 1, 1)
    return torch.where(flip_mask, inputs.flip(-1), inputs)


def batch_crop(images, crop_size):
    r = (images.size(-1) - crop_size) // 2
    shifts = torch.randint(-r, r + 1, size=(len(images), 2), device=images.device)
    images_out = torch.empty((len(images), 3, crop_size, crop_size), device=images.device, dtype=images.dtype)
    # airbench: for r <= 2 a loop over every offset with a boolean mask is fastest
    for sy in range(-r, r + 1):
        for sx in range(-r, r + 1):
            mask = (shifts[:, 0] == sy) & (shifts[:, 1] == sx)
            images_out[mask] = images[mask, :, r + sy:r + sy + crop_size, r + sx:r + sx + crop_size]
    return images_out


class CifarLoader:
    def __init__(self, data, train=True, batch_size=500, aug=None, drop_last=None, shuffle=None):
        self.images, self.labels = data["images"].to(device), data["labels"].to(device)
        # it's faster to load+process uint8 data than to load preprocessed fp16 data
        self.images = (self.images.half() / 255).permute(0, 3, 1, 2).to(memory_format=torch.channels_last)
        self.mean = CIFAR_MEAN.to(device).half().view(1, 3, 1, 1)
        self.std = CIFAR_STD.to(device).half().view(1, 3, 1, 1)
        self.proc_images = {}  # saved results of image processing done on the first epoch
        self.epoch = 0
        self.aug = aug or {}
        self.batch_size = batch_size
        self.drop_last = train if drop_last is None else drop_last
        self.shuffle = train if shuffle is None else shuffle

    def normalize(self, x):
        return (x - self.mean) / self.std

    def __len__(self):
        return len(self.images) // self.batch_size if self.drop_last else math.ceil(len(self.images) / self.batch_size)

    def __iter__(self):
        if self.epoch == 0:
            images = self.proc_images["norm"] = self.normalize(self.images)
            # pre-flip images in order to do every-other epoch flipping scheme
            if self.aug.get("flip", False):
                images = self.proc_images["flip"] = batch_flip_lr(images)
            # pre-pad images to save time when doing random translation
            pad = self.aug.get("translate", 0)
            if pad > 0:
                self.proc_images["pad"] = F.pad(images, (pad,) * 4, "reflect")
        if self.aug.get("translate", 0) > 0:
            images = batch_crop(self.proc_images["pad"], self.images.shape[-2])
        elif self.aug.get("flip", False):
            images = self.proc_images["flip"]
        else:
            images = self.proc_images["norm"]
        if self.aug.get("flip", False) and self.epoch % 2 == 1:
            images = images.flip(-1)
        self.epoch += 1
        indices = (torch.randperm if self.shuffle else torch.arange)(len(images), device=images.device)
        for i in range(len(self)):
            idxs = indices[i * self.batch_size:(i + 1) * self.batch_size]
            yield images[idxs], self.labels[idxs]


# ---------------------------------------------------------------- network
class Flatten(nn.Module):
    def forward(self, x):
        return x.view(x.size(0), -1)


class Mul(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return x * self.scale


class BatchNorm(nn.BatchNorm2d):
    def __init__(self, num_features, momentum, eps=1e-12, weight=False, bias=True):
        super().__init__(num_features, eps=eps, momentum=1 - momentum)
        self.weight.requires_grad = weight
        self.bias.requires_grad = bias


class Conv(nn.Conv2d):
    def __init__(self, in_channels, out_channels, kernel_size=3, padding="same", bias=False):
        super().__init__(in_channels, out_channels, kernel_size=kernel_size, padding=padding, bias=bias)

    def reset_parameters(self):
        super().reset_parameters()
        if self.bias is not None:
            self.bias.data.zero_()
        w = self.weight.data
        torch.nn.init.dirac_(w[:w.size(1)])


class ConvGroup(nn.Module):
    def __init__(self, channels_in, channels_out, batchnorm_momentum):
        super().__init__()
        self.conv1 = Conv(channels_in, channels_out)
        self.pool = nn.MaxPool2d(2)
        self.norm1 = BatchNorm(channels_out, batchnorm_momentum)
        self.conv2 = Conv(channels_out, channels_out)
        self.norm2 = BatchNorm(channels_out, batchnorm_momentum)
        self.activ = nn.GELU()

    def forward(self, x):
        x = self.conv1(x)
        x = self.pool(x)
        x = self.norm1(x)
        x = self.activ(x)
        x = self.conv2(x)
        x = self.norm2(x)
        x = self.activ(x)
        return x


def make_net(widths):
    bn_mom = hyp["net"]["batchnorm_momentum"]
    whiten_kernel_size = 2
    whiten_width = 2 * 3 * whiten_kernel_size ** 2
    net = nn.Sequential(
        Conv(3, whiten_width, whiten_kernel_size, padding=0, bias=True),
        nn.GELU(),
        ConvGroup(whiten_width, widths[0], bn_mom),
        ConvGroup(widths[0], widths[1], bn_mom),
        ConvGroup(widths[1], widths[2], bn_mom),
        nn.MaxPool2d(3),
        Flatten(),
        nn.Linear(widths[2], 10, bias=False),
        Mul(hyp["net"]["scaling_factor"]),
    )
    net[0].weight.requires_grad = False
    net = net.to(device).to(memory_format=torch.channels_last)
    net.half()
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.float()
    return net


# ---------------------------------------------------------------- whitening initialisation
def get_patches(x, patch_shape):
    c, (h, w) = x.shape[1], patch_shape
    return x.unfold(2, h, 1).unfold(3, w, 1).transpose(1, 3).reshape(-1, c, h, w).float()


def get_whitening_parameters(patches):
    n, c, h, w = patches.shape
    patches_flat = patches.view(n, -1)
    est_patch_covariance = (patches_flat.T @ patches_flat) / n
    eigenvalues, eigenvectors = torch.linalg.eigh(est_patch_covariance, UPLO="U")
    return eigenvalues.flip(0).view(-1, 1, 1, 1), eigenvectors.T.reshape(c * h * w, c, h, w).flip(0)


@torch.no_grad()
def init_whitening_conv(layer, train_set, eps=5e-4):
    patches = get_patches(train_set, patch_shape=layer.weight.data.shape[2:])
    eigenvalues, eigenvectors = get_whitening_parameters(patches)
    eigenvectors_scaled = eigenvectors / torch.sqrt(eigenvalues + eps)
    layer.weight.data[:] = torch.cat((eigenvectors_scaled, -eigenvectors_scaled))


# ---------------------------------------------------------------- lookahead EMA
class LookaheadState:
    def __init__(self, net):
        self.net_ema = {k: v.clone() for k, v in net.state_dict().items()}

    @torch.no_grad()
    def update(self, net, decay):
        for ema_param, net_param in zip(self.net_ema.values(), net.state_dict().values()):
            if net_param.dtype in (torch.half, torch.float):
                ema_param.lerp_(net_param, 1 - decay)
                net_param.copy_(ema_param)


# ---------------------------------------------------------------- evaluation (flip TTA)
def infer(model, loader, tta_level=1):
    def infer_basic(inputs, net):
        return net(inputs).clone()

    def infer_mirror(inputs, net):
        return 0.5 * net(inputs) + 0.5 * net(inputs.flip(-1))

    infer_fn = [infer_basic, infer_mirror][tta_level]
    model.eval()
    test_images = loader.normalize(loader.images)
    with torch.no_grad():
        return torch.cat([infer_fn(inputs, model) for inputs in test_images.split(2000)])


def evaluate(model, loader, tta_level=1):
    logits = infer(model, loader, tta_level)
    return (logits.argmax(1) == loader.labels).float().mean().item()


# ---------------------------------------------------------------- main
def main():
    torch.manual_seed(0)
    batch_size = args.batch_size
    momentum = hyp["opt"]["momentum"]
    # assuming gradients are constant in time, for Nesterov SGD it helps to divide the lr by (1 - momentum)
    kilostep_scale = 1024 * (1 + 1 / (1 - momentum))
    lr = hyp["opt"]["lr"] / kilostep_scale
    wd = hyp["opt"]["weight_decay"] * batch_size / kilostep_scale
    lr_biases = lr * hyp["opt"]["bias_scaler"]

    loss_fn = nn.CrossEntropyLoss(label_smoothing=hyp["opt"]["label_smoothing"], reduction="none")
    test_loader = CifarLoader(make_fake_cifar(args.test_images, 1), train=False, batch_size=2000)
    train_loader = CifarLoader(make_fake_cifar(args.train_images, 0), train=True, batch_size=batch_size,
                               aug=hyp["aug"])
    total_train_steps = min(args.steps, math.ceil(len(train_loader) * hyp["opt"]["train_epochs"]))

    model = make_net(args.widths)
    current_steps = 0

    norm_biases = [p for k, p in model.named_parameters() if "norm" in k and p.requires_grad]
    other_params = [p for k, p in model.named_parameters() if "norm" not in k and p.requires_grad]
    param_configs = [dict(params=norm_biases, lr=lr_biases, weight_decay=0.0),
                     dict(params=other_params, lr=lr, weight_decay=wd / lr)]
    optimizer = torch.optim.SGD(param_configs, momentum=momentum, nesterov=True)
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]

    def get_lr(step):  # triangular: warm up over the first 23%, then down to 0.07
        warmup_steps = int(total_train_steps * 0.23)
        warmdown_steps = total_train_steps - warmup_steps
        if step < warmup_steps:
            frac = step / warmup_steps
            return 0.2 * (1 - frac) + 1.0 * frac
        frac = (step - warmup_steps) / warmdown_steps
        return 1.0 * (1 - frac) + 0.07 * frac

    alpha_schedule = 0.95 ** 5 * (torch.arange(total_train_steps + 1) / total_train_steps) ** 3
    lookahead_state = LookaheadState(model)

    # initialise the whitening layer with the patches of (up to) 5000 training images
    train_images = train_loader.normalize(train_loader.images[:5000])
    init_whitening_conv(model[0], train_images)

    t0 = time.perf_counter()
    epoch = 0
    while current_steps < total_train_steps:
        model[0].bias.requires_grad = (epoch < hyp["opt"]["whiten_bias_epochs"])
        model.train()
        for inputs, labels in train_loader:
            outputs = model(inputs)
            loss = loss_fn(outputs, labels).sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for group in optimizer.param_groups:  # LambdaLR by hand
                group["lr"] = group["initial_lr"] * get_lr(current_steps)
            optimizer.step()
            current_steps += 1
            if current_steps % 5 == 0:
                lookahead_state.update(model, decay=alpha_schedule[current_steps].item())
            if current_steps % 5 == 0 or current_steps == 1:
                print(f"step {current_steps} loss {loss.item() / len(labels):.4f}")
            if current_steps >= total_train_steps:
                lookahead_state.update(model, decay=1.0)
                break
        epoch += 1

    tta_val_acc = evaluate(model, test_loader, tta_level=hyp["net"]["tta_level"])
    print(f"steps {current_steps} tta_val_acc {tta_val_acc:.4f} time {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
