# SimCLR (sthalles/SimCLR + spijkervet style) with LARS, channels_last, NT-Xent
import argparse
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.optimizer import Optimizer, required

parser = argparse.ArgumentParser(description='PyTorch SimCLR')
parser.add_argument('-b', '--batch-size', default=256, type=int)
parser.add_argument('--img', default=160, type=int)
parser.add_argument('--lr', default=0.3, type=float)
parser.add_argument('--wd', default=1e-6, type=float)
parser.add_argument('--out_dim', default=128, type=int)
parser.add_argument('--temperature', default=0.5, type=float)
parser.add_argument('--n-views', default=2, type=int)
parser.add_argument('--iters', default=5, type=int)
parser.add_argument('--fp16-precision', action='store_true')
parser.add_argument('--device', default='cuda')
args = parser.parse_args()

class LARS(Optimizer):
    """LARS (You et al.), as in many SimCLR repos."""
    def __init__(self, params, lr=required, momentum=0.9, use_nesterov=False, weight_decay=0.0,
                 exclude_from_weight_decay=None, exclude_from_layer_adaptation=None, classic_momentum=True, eeta=0.001):
        defaults = dict(lr=lr, momentum=momentum, use_nesterov=use_nesterov, weight_decay=weight_decay,
                        exclude_from_weight_decay=exclude_from_weight_decay,
                        exclude_from_layer_adaptation=exclude_from_layer_adaptation,
                        classic_momentum=classic_momentum, eeta=eeta)
        super(LARS, self).__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            weight_decay = group["weight_decay"]
            momentum = group["momentum"]
            eeta = group["eeta"]
            lr = group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                param = p.data
                grad = p.grad.data
                param_state = self.state[p]
                if weight_decay != 0 and p.ndim > 1:
                    grad = grad.add(param, alpha=weight_decay)
                trust_ratio = 1.0
                if p.ndim > 1:
                    w_norm = torch.norm(param)
                    g_norm = torch.norm(grad)
                    trust_ratio = torch.where(w_norm.gt(0), torch.where(g_norm.gt(0), (eeta * w_norm / g_norm), torch.ones_like(w_norm)), torch.ones_like(w_norm))
                scaled_lr = lr * trust_ratio
                if "momentum_buffer" not in param_state:
                    next_v = param_state["momentum_buffer"] = torch.zeros_like(p.data)
                else:
                    next_v = param_state["momentum_buffer"]
                next_v.mul_(momentum).add_(grad, alpha=1.0 * 1) if not torch.is_tensor(scaled_lr) else next_v.mul_(momentum).add_(scaled_lr * grad)
                if group["use_nesterov"]:
                    update = (momentum * next_v) + (scaled_lr * grad)
                else:
                    update = next_v
                param.sub_(update if torch.is_tensor(scaled_lr) else update * scaled_lr)
        return loss

class Bottleneck(nn.Module):
    expansion = 4
    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False); self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False); self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False); self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True); self.downsample = downsample
    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)

class ResNet(nn.Module):
    def __init__(self, layers=(3, 4, 6, 3), num_classes=1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False); self.bn1 = nn.BatchNorm2d(64); self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(64, layers[0]); self.layer2 = self._make_layer(128, layers[1], 2)
        self.layer3 = self._make_layer(256, layers[2], 2); self.layer4 = self._make_layer(512, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1)); self.fc = nn.Linear(2048, num_classes)
    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * 4:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes * 4, 1, stride, bias=False), nn.BatchNorm2d(planes * 4))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * 4
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)
    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))

class ResNetSimCLR(nn.Module):
    def __init__(self, out_dim):
        super(ResNetSimCLR, self).__init__()
        self.backbone = ResNet(num_classes=out_dim)
        dim_mlp = self.backbone.fc.in_features
        self.backbone.fc = nn.Sequential(nn.Linear(dim_mlp, dim_mlp), nn.ReLU(), self.backbone.fc)
    def forward(self, x):
        return self.backbone(x)

def augment(x):
    # cheap "augmentations" done on the GPU: random flip + color jitter + noise
    flip = torch.rand(x.shape[0], 1, 1, 1, device=x.device) < 0.5
    x = torch.where(flip, x.flip(-1), x)
    x = x * (0.6 + 0.8 * torch.rand(x.shape[0], 3, 1, 1, device=x.device))
    return (x + 0.05 * torch.randn_like(x)).clamp_(0, 1)

class SimCLR(object):
    def __init__(self, *args, **kwargs):
        self.args = kwargs['args']
        self.model = kwargs['model'].to(self.args.device).to(memory_format=torch.channels_last)
        self.optimizer = kwargs['optimizer']
        self.criterion = torch.nn.CrossEntropyLoss().to(self.args.device)

    def info_nce_loss(self, features):
        labels = torch.cat([torch.arange(self.args.batch_size) for i in range(self.args.n_views)], dim=0)
        labels = (labels.unsqueeze(0) == labels.unsqueeze(1)).float()
        labels = labels.to(self.args.device)
        features = F.normalize(features, dim=1)
        similarity_matrix = torch.matmul(features, features.T)
        mask = torch.eye(labels.shape[0], dtype=torch.bool).to(self.args.device)
        labels = labels[~mask].view(labels.shape[0], -1)
        similarity_matrix = similarity_matrix[~mask].view(similarity_matrix.shape[0], -1)
        positives = similarity_matrix[labels.bool()].view(labels.shape[0], -1)
        negatives = similarity_matrix[~labels.bool()].view(similarity_matrix.shape[0], -1)
        logits = torch.cat([positives, negatives], dim=1)
        labels = torch.zeros(logits.shape[0], dtype=torch.long).to(self.args.device)
        logits = logits / self.args.temperature
        return logits, labels

    def train(self, train_loader):
        scaler = torch.cuda.amp.GradScaler(enabled=self.args.fp16_precision)
        n_iter = 0
        for images, _ in train_loader:
            images = images.to(self.args.device, non_blocking=True)
            images = torch.cat([augment(images), augment(images)], dim=0).contiguous(memory_format=torch.channels_last)
            with torch.cuda.amp.autocast(enabled=self.args.fp16_precision):
                features = self.model(images)
                logits, labels = self.info_nce_loss(features)
                loss = self.criterion(logits, labels)
            self.optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(self.optimizer)
            scaler.update()
            if n_iter % 2 == 0:
                top1 = (logits.argmax(1) == labels).float().mean() * 100
                print(f"iter {n_iter} loss {loss.item():.4f} top1 {top1.item():.2f}")
            n_iter += 1

def loader():
    for i in range(args.iters):
        yield torch.rand(args.batch_size, 3, args.img, args.img).pin_memory() if args.device == 'cuda' else torch.rand(args.batch_size, 3, args.img, args.img), torch.zeros(args.batch_size)

model = ResNetSimCLR(out_dim=args.out_dim)
params_bn_bias = [p for n, p in model.named_parameters() if p.ndim <= 1]
params_w = [p for n, p in model.named_parameters() if p.ndim > 1]
optimizer = LARS([{"params": params_w}, {"params": params_bn_bias, "weight_decay": 0.0}], lr=args.lr, weight_decay=args.wd)
simclr = SimCLR(model=model, optimizer=optimizer, args=args)
simclr.train(loader())
