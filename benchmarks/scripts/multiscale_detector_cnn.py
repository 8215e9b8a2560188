"""YOLO-style multi-scale detector training (yolov5/YOLOX habits, no ultralytics import): CSP backbone + FPN + dense 1x1 prediction head in channels_last, fp16 torch.amp.autocast with torch.amp.GradScaler("cuda"), every 4 iterations a new input size picked on the host with random.choice(range(320, 641, 32)) and the batch resized with F.interpolate, SGD nesterov with three param groups (no weight decay on BN weights and biases), scaler.unscale_ + clip_grad_norm_, warmup by hand, a ModelEMA."""
import argparse
import math
import random
import time
from copy import deepcopy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim import lr_scheduler
from torch.utils.data import DataLoader, Dataset


# ----------------------------------------------------------------------------- models/common.py
def autopad(k, p=None):
    # Pad to 'same' shape outputs
    return k // 2 if p is None else p


class Conv(nn.Module):
    # Standard convolution with args(ch_in, ch_out, kernel, stride, padding, groups, activation)
    def __init__(self, c1, c2, k=1, s=1, p=None, g=1, act=True):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, autopad(k, p), groups=g, bias=False)
        self.bn = nn.BatchNorm2d(c2)
        self.act = nn.SiLU() if act is True else (act if isinstance(act, nn.Module) else nn.Identity())

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class Bottleneck(nn.Module):
    # Standard bottleneck
    def __init__(self, c1, c2, shortcut=True, g=1, e=0.5):
        super().__init__()
        c_ = int(c2 * e)  # hidden channels
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c_, c2, 3, 1, g=g)
        self.add = shortcut and c1 == c2

    def forward(self, x):
        return x + self.cv2(self.cv1(x)) if self.add else self.cv2(self.cv1(x))


class C3(nn.Module):
    # CSP Bottleneck with 3 convolutions
    def __init__(self, c1, c2, n=1, shortcut=True, g=1, e=0.5):
        super().__init__()
        c_ = int(c2 * e)  # hidden channels
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c1, c_, 1, 1)
        self.cv3 = Conv(2 * c_, c2, 1)
        self.m = nn.Sequential(*(Bottleneck(c_, c_, shortcut, g, e=1.0) for _ in range(n)))

    def forward(self, x):
        return self.cv3(torch.cat((self.m(self.cv1(x)), self.cv2(x)), 1))


class SPPF(nn.Module):
    # Spatial Pyramid Pooling - Fast (SPPF) layer by Glenn Jocher
    def __init__(self, c1, c2, k=5):
        super().__init__()
        c_ = c1 // 2  # hidden channels
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c_ * 4, c2, 1, 1)
        self.m = nn.MaxPool2d(kernel_size=k, stride=1, padding=k // 2)

    def forward(self, x):
        x = self.cv1(x)
        y1 = self.m(x)
        y2 = self.m(y1)
        return self.cv2(torch.cat((x, y1, y2, self.m(y2)), 1))


# ----------------------------------------------------------------------------- models/yolo.py
class Detect(nn.Module):
    # anchor-free dense head: per cell (obj, x, y, log w, log h, classes...)
    def __init__(self, nc=80, ch=(), stride=()):
        super().__init__()
        self.nc = nc
        self.no = nc + 5
        self.nl = len(ch)
        self.register_buffer("stride", torch.tensor(stride, dtype=torch.float32))
        self.m = nn.ModuleList(nn.Conv2d(x, self.no, 1) for x in ch)

    def forward(self, x):
        return [self.m[i](x[i]) for i in range(self.nl)]


class DetectionModel(nn.Module):
    def __init__(self, nc=80, width_multiple=0.5, depth_multiple=0.33):
        super().__init__()
        w = lambda c: max(round(c * width_multiple / 8) * 8, 8)  # noqa: E731
        d = lambda n: max(round(n * depth_multiple), 1)  # noqa: E731
        # backbone (CSPDarknet)
        self.stem = Conv(3, w(64), 6, 2, 2)                                  # 0-P1/2
        self.stage1 = nn.Sequential(Conv(w(64), w(128), 3, 2), C3(w(128), w(128), d(3)))     # P2/4
        self.stage2 = nn.Sequential(Conv(w(128), w(256), 3, 2), C3(w(256), w(256), d(6)))    # P3/8
        self.stage3 = nn.Sequential(Conv(w(256), w(512), 3, 2), C3(w(512), w(512), d(9)))    # P4/16
        self.stage4 = nn.Sequential(Conv(w(512), w(1024), 3, 2), C3(w(1024), w(1024), d(3)),
                                    SPPF(w(1024), w(1024), 5))                             # P5/32
        # neck (FPN, top-down)
        self.lat5 = Conv(w(1024), w(512), 1, 1)
        self.up = nn.Upsample(None, 2, "nearest")
        self.c3_p4 = C3(w(1024), w(512), d(3), False)
        self.lat4 = Conv(w(512), w(256), 1, 1)
        self.c3_p3 = C3(w(512), w(256), d(3), False)
        self.detect = Detect(nc, ch=(w(256), w(512), w(1024)), stride=(8, 16, 32))
        self._initialize_biases()

    def forward(self, x):
        x = self.stage1(self.stem(x))
        p3 = self.stage2(x)
        p4 = self.stage3(p3)
        p5 = self.stage4(p4)
        n4 = self.c3_p4(torch.cat((self.up(self.lat5(p5)), p4), 1))
        n3 = self.c3_p3(torch.cat((self.up(self.lat4(n4)), p3), 1))
        return self.detect([n3, n4, p5])

    def _initialize_biases(self):
        # https://arxiv.org/abs/1708.02002 section 3.3
        m = self.detect
        for mi, s in zip(m.m, m.stride):
            b = mi.bias.data
            b[0] += math.log(8 / (640 / s) ** 2)  # obj (8 objects per 640 image)
            b[5:] += math.log(0.6 / (m.nc - 0.99999))  # cls


# ----------------------------------------------------------------------------- utils/loss.py
class ComputeLoss:
    # each target is assigned to the cell holding its centre on the level whose size range fits it
    def __init__(self, model, box_gain=0.05, obj_gain=1.0, cls_gain=0.5):
        device = next(model.parameters()).device
        self.BCEcls = nn.BCEWithLogitsLoss()
        self.BCEobj = nn.BCEWithLogitsLoss()
        self.balance = [4.0, 1.0, 0.4]  # P3-P5
        self.ranges = [(0, 64), (64, 128), (128, 1e8)]  # pixel size handled by each level
        self.hyp = dict(box=box_gain, obj=obj_gain, cls=cls_gain)
        self.nc = model.detect.nc
        self.device = device

    def __call__(self, preds, targets, imgsz):  # targets: (n, 6) image, class, x, y, w, h (normalised)
        lcls = torch.zeros(1, device=self.device)
        lbox = torch.zeros(1, device=self.device)
        lobj = torch.zeros(1, device=self.device)
        bs = preds[0].shape[0]
        max_side = targets[:, 4:6].max(1)[0] * imgsz
        for i, p in enumerate(preds):
            p = p.permute(0, 2, 3, 1)  # (b, ny, nx, no)
            _, ny, nx, _ = p.shape
            tobj = torch.zeros(p.shape[:3], dtype=p.dtype, device=self.device)
            lo, hi = self.ranges[i]
            t = targets[(max_side >= lo) & (max_side < hi)]
            n = t.shape[0]
            if n:
                b, c = t[:, :2].long().T
                gain = torch.tensor([nx, ny], device=self.device)
                gxy = t[:, 2:4] * gain
                gij = gxy.long()
                gi, gj = gij[:, 0].clamp_(0, nx - 1), gij[:, 1].clamp_(0, ny - 1)
                ps = p[b, gj, gi]  # prediction subset corresponding to targets
                pxy = ps[:, 1:3].sigmoid()
                pwh = ps[:, 3:5]
                tbox = torch.cat((gxy - gij, torch.log(t[:, 4:6] * gain + 1e-9)), 1)
                lbox += F.smooth_l1_loss(torch.cat((pxy, pwh), 1), tbox)
                tobj[b, gj, gi] = 1.0
                tcls = torch.zeros_like(ps[:, 5:])
                tcls[range(n), c] = 1.0
                lcls += self.BCEcls(ps[:, 5:], tcls)
            lobj += self.BCEobj(p[..., 0], tobj) * self.balance[i]
        lbox *= self.hyp["box"]
        lobj *= self.hyp["obj"]
        lcls *= self.hyp["cls"]
        return (lbox + lobj + lcls) * bs, torch.cat((lbox, lobj, lcls)).detach()


# ----------------------------------------------------------------------------- utils/torch_utils.py
def de_parallel(model):
    return model.module if isinstance(model, (nn.parallel.DataParallel, nn.parallel.DistributedDataParallel)) else model


class ModelEMA:
    """ Updated Exponential Moving Average (EMA) from https://github.com/rwightman/pytorch-image-models
    Keeps a moving average of everything in the model state_dict (parameters and buffers)
    """

    def __init__(self, model, decay=0.9999, tau=2000, updates=0):
        self.ema = deepcopy(de_parallel(model)).eval()  # FP32 EMA
        self.updates = updates  # number of EMA updates
        self.decay = lambda x: decay * (1 - math.exp(-x / tau))  # decay exponential ramp (to help early epochs)
        for p in self.ema.parameters():
            p.requires_grad_(False)

    def update(self, model):
        self.updates += 1
        d = self.decay(self.updates)
        msd = de_parallel(model).state_dict()  # model state_dict
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v *= d
                v += (1 - d) * msd[k].detach()


def smart_optimizer(model, lr=0.001, momentum=0.9, decay=1e-5):
    # 3 param groups: 0) weights with decay, 1) BN weights without decay, 2) biases without decay
    g = [], [], []
    bn = tuple(v for k, v in nn.__dict__.items() if "Norm" in k)  # normalization layers, i.e. BatchNorm2d()
    for v in model.modules():
        for p_name, p in v.named_parameters(recurse=False):
            if p_name == "bias":  # bias (no decay)
                g[2].append(p)
            elif p_name == "weight" and isinstance(v, bn):  # weight (no decay)
                g[1].append(p)
            else:
                g[0].append(p)  # weight (with decay)
    optimizer = torch.optim.SGD(g[2], lr=lr, momentum=momentum, nesterov=True)
    optimizer.add_param_group({"params": g[0], "weight_decay": decay})  # add g0 with weight_decay
    optimizer.add_param_group({"params": g[1], "weight_decay": 0.0})  # add g1 (BatchNorm2d weights)
    print(f"optimizer: SGD(lr={lr}) with parameter groups "
          f"{len(g[1])} weight(decay=0.0), {len(g[0])} weight(decay={decay}), {len(g[2])} bias")
    return optimizer


def interp(x, xp, fp):
    # np.interp for two points
    if x <= xp[0]:
        return fp[0]
    if x >= xp[1]:
        return fp[1]
    return fp[0] + (fp[1] - fp[0]) * (x - xp[0]) / (xp[1] - xp[0])


# ----------------------------------------------------------------------------- data (synthetic, cached in RAM)
class SyntheticDetectionDataset(Dataset):
    def __init__(self, n, img_size=640, nc=80, max_labels=12, seed=0):
        self.n, self.img_size, self.nc, self.max_labels, self.seed = n, img_size, nc, max_labels, seed

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(self.seed + index)
        img = torch.randint(0, 256, (3, self.img_size, self.img_size), dtype=torch.uint8, generator=g)
        nl = int(torch.randint(1, self.max_labels + 1, (1,), generator=g))
        labels_out = torch.zeros((nl, 6))
        labels_out[:, 1] = torch.randint(0, self.nc, (nl,), generator=g).float()
        labels_out[:, 2:4] = torch.rand(nl, 2, generator=g) * 0.8 + 0.1  # xy
        labels_out[:, 4:6] = torch.rand(nl, 2, generator=g) * 0.45 + 0.02  # wh
        return img, labels_out

    @staticmethod
    def collate_fn(batch):
        im, label = zip(*batch)  # transposed
        for i, lb in enumerate(label):
            lb[:, 0] = i  # add target image index for build_targets()
        return torch.stack(im, 0), torch.cat(label, 0)


# ----------------------------------------------------------------------------- train.py
def parse_opt():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--imgsz", type=int, default=640, help="train image size (pixels), max of the multi-scale range")
    parser.add_argument("--multi-scale-sizes", type=int, nargs=3, default=[320, 640, 32], help="min max step")
    parser.add_argument("--multi-scale-interval", type=int, default=4, help="pick a new size every N iterations")
    parser.add_argument("--nc", type=int, default=80)
    parser.add_argument("--lr0", type=float, default=0.01)
    parser.add_argument("--lrf", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.937)
    parser.add_argument("--weight-decay", type=float, default=0.0005)
    parser.add_argument("--warmup-iters", type=int, default=3)
    parser.add_argument("--warmup-bias-lr", type=float, default=0.1)
    parser.add_argument("--warmup-momentum", type=float, default=0.8)
    parser.add_argument("--steps", type=int, default=10, help="iterations to train")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main(opt):
    random.seed(opt.seed)
    torch.manual_seed(opt.seed)
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    amp = True

    model = DetectionModel(nc=opt.nc).to(device).to(memory_format=torch.channels_last)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    gs = int(model.detect.stride.max())  # grid size (max stride)

    optimizer = smart_optimizer(model, opt.lr0, opt.momentum, opt.weight_decay)
    epochs = 1
    lf = lambda x: (1 - x / epochs) * (1.0 - opt.lrf) + opt.lrf  # noqa: E731 (linear)
    scheduler = lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    ema = ModelEMA(model)
    scaler = torch.amp.GradScaler("cuda", enabled=amp)
    compute_loss = ComputeLoss(model)

    dataset = SyntheticDetectionDataset(opt.steps * opt.batch_size, opt.imgsz, opt.nc, seed=opt.seed)
    loader = DataLoader(dataset, batch_size=opt.batch_size, shuffle=True, num_workers=opt.workers,
                        pin_memory=True, collate_fn=SyntheticDetectionDataset.collate_fn, drop_last=True)

    lo, hi, step = opt.multi_scale_sizes
    sizes = list(range(lo, hi + 1, step))
    assert all(s % gs == 0 for s in sizes), f"multi-scale sizes must be multiples of max stride {gs}"
    imgsz = opt.imgsz
    nw = opt.warmup_iters
    mloss = torch.zeros(3, device=device)  # mean losses
    t0 = time.time()

    model.train()
    for epoch in range(epochs):
        optimizer.zero_grad()
        for i, (imgs, targets) in enumerate(loader):
            ni = i + len(loader) * epoch  # number integrated batches (since train start)
            imgs = imgs.to(device, non_blocking=True).float() / 255  # uint8 to float32, 0-255 to 0.0-1.0
            imgs = imgs.contiguous(memory_format=torch.channels_last)

            # Warmup
            if ni <= nw:
                for j, x in enumerate(optimizer.param_groups):
                    # bias lr falls from 0.1 to lr0, all other lrs rise from 0.0 to lr0
                    x["lr"] = interp(ni, [0, nw], [opt.warmup_bias_lr if j == 0 else 0.0, x["initial_lr"] * lf(epoch)])
                    if "momentum" in x:
                        x["momentum"] = interp(ni, [0, nw], [opt.warmup_momentum, opt.momentum])

            # Multi-scale: a new random size every few iterations (YOLOX random_resize)
            if ni % opt.multi_scale_interval == 0:
                imgsz = random.choice(sizes)
            if imgsz != imgs.shape[-1]:
                imgs = F.interpolate(imgs, size=(imgsz, imgsz), mode="bilinear", align_corners=False)

            # Forward
            with torch.amp.autocast("cuda", dtype=torch.float16, enabled=amp):
                pred = model(imgs)  # forward
                loss, loss_items = compute_loss(pred, targets.to(device), imgsz)  # loss scaled by batch_size

            # Backward
            scaler.scale(loss).backward()

            # Optimize
            scaler.unscale_(optimizer)  # unscale gradients
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)  # clip gradients
            scaler.step(optimizer)  # optimizer.step
            scaler.update()
            optimizer.zero_grad()
            ema.update(model)

            # Log
            mloss = (mloss * i + loss_items) / (i + 1)  # update mean losses
            if i % 2 == 0 or i == len(loader) - 1:
                mem = f"{torch.cuda.memory_reserved() / 1E9 if torch.cuda.is_available() else 0:.3g}G"  # (GB)
                print(("%11s" * 2 + "%11.4g" * 5) %
                      (f"{epoch}/{epochs - 1}", mem, *mloss.tolist(), targets.shape[0], imgs.shape[-1]),
                      f"  {time.time() - t0:.1f}s")

        # Scheduler
        scheduler.step()
    print(f"{epochs} epochs ({opt.steps} iterations) completed in {(time.time() - t0) / 3600:.3f} hours.")


if __name__ == "__main__":
    main(parse_opt())
