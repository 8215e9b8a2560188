"""BYOL (lucidrains/byol-pytorch habit): online ResNet-18 + projector + predictor, a lazily deep-copied target network updated by EMA under no_grad, two views augmented on the GPU by hand (per-sample random resized crop with F.interpolate, torch.where flips, per-sample colour jitter), symmetric 2 - 2*cosine loss, a hand-written LARS (trust ratio from p.norm() / grad norm, biases and BN excluded), channels_last, bf16 autocast."""
import argparse
import copy
import math
import random
import time
from functools import wraps

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------- ResNet-18 (as torchvision writes it)
class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, layers=(2, 2, 2, 2), num_classes=1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2)
        self.layer4 = self._make_layer(512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        for _ in range(1, blocks):
            layers.append(BasicBlock(self.inplanes, planes))
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


# ---------------------------------------------------------------- GPU augmentations
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def random_resized_crop(x, size, scale=(0.08, 1.0), ratio=(3. / 4., 4. / 3.)):
    """RandomResizedCrop per sample: crop a random box of each image and resize it with F.interpolate."""
    B, _, H, W = x.shape
    area = H * W
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    out = []
    for i in range(B):
        for _ in range(10):
            target_area = area * random.uniform(*scale)
            aspect_ratio = math.exp(random.uniform(*log_ratio))
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= W and 0 < h <= H:
                top = random.randint(0, H - h)
                left = random.randint(0, W - w)
                break
        else:  # fallback to central crop
            h, w = H, W
            top, left = 0, 0
        crop = x[i:i + 1, :, top:top + h, left:left + w]
        out.append(F.interpolate(crop, size=(size, size), mode="bilinear", align_corners=False))
    return torch.cat(out, dim=0)


def random_hflip(x, p=0.5):
    B = x.size(0)
    return torch.where(torch.rand(B, 1, 1, 1, device=x.device) < p, x.flip(-1), x)


def rgb_to_grayscale(x):
    return (0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3])


def color_jitter(x, brightness=0.8, contrast=0.8, saturation=0.8, p=0.8):
    B = x.size(0)

    def factor(s):
        return torch.empty(B, 1, 1, 1, device=x.device).uniform_(max(0., 1. - s), 1. + s)

    y = x * factor(brightness)
    mean = rgb_to_grayscale(y).mean(dim=(1, 2, 3), keepdim=True)
    y = (y - mean) * factor(contrast) + mean
    gray = rgb_to_grayscale(y)
    y = (y - gray) * factor(saturation) + gray
    y = y.clamp(0., 1.)
    apply = torch.rand(B, 1, 1, 1, device=x.device) < p
    return torch.where(apply, y, x)


def random_grayscale(x, p=0.2):
    B = x.size(0)
    return torch.where(torch.rand(B, 1, 1, 1, device=x.device) < p, rgb_to_grayscale(x).expand_as(x), x)


class DefaultAugment(nn.Module):
    def __init__(self, image_size):
        super().__init__()
        self.image_size = image_size
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)

    def forward(self, x):
        x = random_resized_crop(x, self.image_size)
        x = random_hflip(x)
        x = color_jitter(x)
        x = random_grayscale(x)
        x = (x - self.mean) / self.std
        return x.contiguous(memory_format=torch.channels_last)


# ---------------------------------------------------------------- BYOL (byol_pytorch/byol_pytorch.py)
def default(val, def_val):
    return def_val if val is None else val


def flatten(t):
    return t.reshape(t.shape[0], -1)


def singleton(cache_key):
    def inner_fn(fn):
        @wraps(fn)
        def wrapper(self, *args, **kwargs):
            instance = getattr(self, cache_key)
            if instance is not None:
                return instance
            instance = fn(self, *args, **kwargs)
            setattr(self, cache_key, instance)
            return instance
        return wrapper
    return inner_fn


def get_module_device(module):
    return next(module.parameters()).device


def set_requires_grad(model, val):
    for p in model.parameters():
        p.requires_grad = val


def loss_fn(x, y):
    return 2 - 2 * F.cosine_similarity(x, y, dim=-1)


class EMA:
    def __init__(self, beta):
        super().__init__()
        self.beta = beta

    def update_average(self, old, new):
        if old is None:
            return new
        return old * self.beta + (1 - self.beta) * new


def update_moving_average(ema_updater, ma_model, current_model):
    for current_params, ma_params in zip(current_model.parameters(), ma_model.parameters()):
        old_weight, up_weight = ma_params.data, current_params.data
        ma_params.data = ema_updater.update_average(old_weight, up_weight)


def MLP(dim, projection_size, hidden_size=4096):
    return nn.Sequential(
        nn.Linear(dim, hidden_size),
        nn.BatchNorm1d(hidden_size),
        nn.ReLU(inplace=True),
        nn.Linear(hidden_size, projection_size),
    )


class NetWrapper(nn.Module):
    """Wraps the base network; a forward hook on the hidden layer gives the representation to project."""

    def __init__(self, net, projection_size, projection_hidden_size, layer=-2):
        super().__init__()
        self.net = net
        self.layer = layer
        self.projector = None
        self.projection_size = projection_size
        self.projection_hidden_size = projection_hidden_size
        self.hidden = {}
        self.hook_registered = False

    def _find_layer(self):
        if type(self.layer) == str:
            modules = dict([*self.net.named_modules()])
            return modules.get(self.layer, None)
        elif type(self.layer) == int:
            children = [*self.net.children()]
            return children[self.layer]
        return None

    def _hook(self, _, input, output):
        device = input[0].device
        self.hidden[device] = flatten(output)

    def _register_hook(self):
        layer = self._find_layer()
        assert layer is not None, f"hidden layer ({self.layer}) not found"
        layer.register_forward_hook(self._hook)
        self.hook_registered = True

    @singleton("projector")
    def _get_projector(self, hidden):
        _, dim = hidden.shape
        projector = MLP(dim, self.projection_size, self.projection_hidden_size)
        return projector.to(hidden)

    def get_representation(self, x):
        if self.layer == -1:
            return self.net(x)
        if not self.hook_registered:
            self._register_hook()
        self.hidden.clear()
        _ = self.net(x)
        hidden = self.hidden[x.device]
        self.hidden.clear()
        assert hidden is not None, f"hidden layer {self.layer} never emitted an output"
        return hidden

    def forward(self, x, return_projection=True):
        representation = self.get_representation(x)
        if not return_projection:
            return representation
        projector = self._get_projector(representation)
        projection = projector(representation)
        return projection, representation


class BYOL(nn.Module):
    def __init__(self, net, image_size, hidden_layer=-2, projection_size=256, projection_hidden_size=4096,
                 moving_average_decay=0.99):
        super().__init__()
        self.net = net
        self.augment1 = DefaultAugment(image_size)
        self.augment2 = DefaultAugment(image_size)
        self.online_encoder = NetWrapper(net, projection_size, projection_hidden_size, layer=hidden_layer)
        self.target_encoder = None
        self.target_ema_updater = EMA(moving_average_decay)
        self.online_predictor = MLP(projection_size, projection_size, projection_hidden_size)

        # get device of network and make wrapper same device
        device = get_module_device(net)
        self.to(device)

        # send a mock image tensor to instantiate singleton parameters
        self.forward(torch.randn(2, 3, image_size, image_size, device=device))

    @singleton("target_encoder")
    def _get_target_encoder(self):
        target_encoder = copy.deepcopy(self.online_encoder)
        set_requires_grad(target_encoder, False)
        return target_encoder

    def reset_moving_average(self):
        del self.target_encoder
        self.target_encoder = None

    def update_moving_average(self):
        assert self.target_encoder is not None, "target encoder has not been created yet"
        update_moving_average(self.target_ema_updater, self.target_encoder, self.online_encoder)

    def forward(self, x, return_embedding=False, return_projection=True):
        assert not (self.training and x.shape[0] == 1), \
            "you must have greater than 1 sample when training, due to the batchnorm in the projection layer"

        if return_embedding:
            return self.online_encoder(x, return_projection=return_projection)

        image_one, image_two = self.augment1(x), self.augment2(x)
        images = torch.cat((image_one, image_two), dim=0)

        online_projections, _ = self.online_encoder(images)
        online_predictions = self.online_predictor(online_projections)
        online_pred_one, online_pred_two = online_predictions.chunk(2, dim=0)

        with torch.no_grad():
            target_encoder = self._get_target_encoder()
            target_projections, _ = target_encoder(images)
            target_projections = target_projections.detach()
            target_proj_one, target_proj_two = target_projections.chunk(2, dim=0)

        loss_one = loss_fn(online_pred_one, target_proj_two.detach())
        loss_two = loss_fn(online_pred_two, target_proj_one.detach())

        loss = loss_one + loss_two
        return loss.mean()


# ---------------------------------------------------------------- LARS (facebookresearch/barlowtwins habit)
def exclude_bias_and_norm(p):
    return p.ndim == 1


class LARS(torch.optim.Optimizer):
    def __init__(self, params, lr, weight_decay=0, momentum=0.9, eta=0.001,
                 weight_decay_filter=None, lars_adaptation_filter=None):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, eta=eta,
                        weight_decay_filter=weight_decay_filter, lars_adaptation_filter=lars_adaptation_filter)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                dp = p.grad

                if dp is None:
                    continue

                if g["weight_decay_filter"] is None or not g["weight_decay_filter"](p):
                    dp = dp.add(p, alpha=g["weight_decay"])

                if g["lars_adaptation_filter"] is None or not g["lars_adaptation_filter"](p):
                    param_norm = p.norm()
                    update_norm = dp.norm()
                    one = torch.ones_like(param_norm)
                    q = torch.where(param_norm > 0.,
                                    torch.where(update_norm > 0, (g["eta"] * param_norm / update_norm), one), one)
                    dp = dp.mul(q)

                param_state = self.state[p]
                if "mu" not in param_state:
                    param_state["mu"] = torch.zeros_like(p)
                mu = param_state["mu"]
                mu.mul_(g["momentum"]).add_(dp)

                p.add_(mu, alpha=-g["lr"])


def adjust_learning_rate(args, optimizer, step, total_steps, warmup_steps):
    base_lr = args.lr * args.batch_size / 256
    if step < warmup_steps:
        lr = base_lr * step / warmup_steps
    else:
        step -= warmup_steps
        max_steps = max(total_steps - warmup_steps, 1)
        q = 0.5 * (1 + math.cos(math.pi * step / max_steps))
        end_lr = base_lr * 0.001
        lr = base_lr * q + end_lr * (1 - q)
    optimizer.param_groups[0]["lr"] = lr
    optimizer.param_groups[1]["lr"] = lr * args.lr_biases_scale
    return lr


def main():
    parser = argparse.ArgumentParser(description="BYOL on random images")
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--source_size", type=int, default=256, help="size of the raw images before cropping")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--lr_biases_scale", type=float, default=0.024)
    parser.add_argument("--weight_decay", type=float, default=1.5e-6)
    parser.add_argument("--moving_average_decay", type=float, default=0.99)
    parser.add_argument("--warmup_steps", type=int, default=2)
    parser.add_argument("--print_freq", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    random.seed(0)
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda")

    resnet = ResNet().to(device).to(memory_format=torch.channels_last)
    learner = BYOL(resnet, image_size=args.image_size, hidden_layer="avgpool",
                   moving_average_decay=args.moving_average_decay)

    param_weights, param_biases = [], []
    for p in learner.parameters():
        if not p.requires_grad:
            continue
        (param_biases if p.ndim == 1 else param_weights).append(p)
    parameters = [{"params": param_weights}, {"params": param_biases}]
    optimizer = LARS(parameters, lr=0, weight_decay=args.weight_decay,
                     weight_decay_filter=exclude_bias_and_norm, lars_adaptation_filter=exclude_bias_and_norm)
    print(f"online params: {sum(p.numel() for p in learner.online_encoder.parameters()) / 1e6:.1f}M, "
          f"predictor: {sum(p.numel() for p in learner.online_predictor.parameters()) / 1e6:.1f}M")

    start = time.time()
    for step in range(args.steps):
        # a batch of raw uint8 images, as a GPU decoder (e.g. DALI / nvjpeg) would hand them over
        raw = torch.randint(0, 256, (args.batch_size, 3, args.source_size, args.source_size),
                            dtype=torch.uint8, device=device)
        images = raw.float().div_(255)

        lr = adjust_learning_rate(args, optimizer, step, args.steps, args.warmup_steps)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = learner(images)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        learner.update_moving_average()  # update moving average of target encoder

        if step % args.print_freq == 0:
            print(f"step {step} lr {lr:.4f} loss {loss.item():.4f} time {int(time.time() - start)}s "
                  f"mem {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
