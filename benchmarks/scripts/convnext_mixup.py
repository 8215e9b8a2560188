# ConvNeXt-Tiny classification, timm-style train loop without timm:
# GPU mixup/cutmix, label smoothing into soft targets, AdamW with no weight decay on norms/biases,
# warmup + cosine LR, bf16 autocast, clip_grad_norm_, EMA via torch.optim.swa_utils.AveragedModel.
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torchvision.models import convnext_tiny

device = "cuda"
num_classes = 100
batch_size = 64
img_size = 224
steps = 10
warmup_steps = 3
base_lr = 4e-3 * batch_size / 4096
mixup_alpha, cutmix_alpha, mix_prob, switch_prob = 0.8, 1.0, 1.0, 0.5
smoothing = 0.1


def one_hot(x, num_classes, on_value=1.0, off_value=0.0):
    x = x.long().view(-1, 1)
    return torch.full((x.size(0), num_classes), off_value, device=x.device).scatter_(1, x, on_value)


def rand_bbox(img_shape, lam):
    H, W = img_shape[-2:]
    cut_rat = math.sqrt(1.0 - lam)
    cut_h, cut_w = int(H * cut_rat), int(W * cut_rat)
    cy, cx = np.random.randint(H), np.random.randint(W)
    y1, y2 = np.clip(cy - cut_h // 2, 0, H), np.clip(cy + cut_h // 2, 0, H)
    x1, x2 = np.clip(cx - cut_w // 2, 0, W), np.clip(cx + cut_w // 2, 0, W)
    return y1, y2, x1, x2


beta_cutmix = torch.distributions.Beta(torch.tensor([cutmix_alpha], device=device),
                                       torch.tensor([cutmix_alpha], device=device))


def mixup_cutmix(x, target):
    """Batch-wise mixup / cutmix on the GPU; returns mixed images and soft targets."""
    off = smoothing / num_classes
    y1 = one_hot(target, num_classes, 1.0 - smoothing + off, off)
    index = torch.randperm(x.size(0), device=x.device)
    y2 = y1[index]
    if np.random.rand() > mix_prob:
        return x, y1
    if np.random.rand() < switch_prob:
        lam = float(beta_cutmix.sample().item())
        yl, yh, xl, xh = rand_bbox(x.shape, lam)
        x[:, :, yl:yh, xl:xh] = x[index, :, yl:yh, xl:xh]
        lam = 1.0 - (yh - yl) * (xh - xl) / float(x.shape[-2] * x.shape[-1])  # correct for clipping
    else:
        lam = float(np.random.beta(mixup_alpha, mixup_alpha))
        x = x.mul(lam).add_(x[index].mul(1.0 - lam))
    return x, y1 * lam + y2 * (1.0 - lam)


class SoftTargetCrossEntropy(nn.Module):
    def forward(self, x, target):
        loss = torch.sum(-target * F.log_softmax(x, dim=-1), dim=-1)
        return loss.mean()


def param_groups_weight_decay(model, weight_decay=0.05):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name.endswith(".bias") else decay).append(p)
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


model = convnext_tiny(weights=None, num_classes=num_classes, stochastic_depth_prob=0.1).to(device)
model_ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9998), use_buffers=True)
optimizer = torch.optim.AdamW(param_groups_weight_decay(model), lr=base_lr, betas=(0.9, 0.999))
scheduler = torch.optim.lr_scheduler.SequentialLR(
    optimizer,
    [torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=warmup_steps),
     torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps - warmup_steps, eta_min=1e-6)],
    milestones=[warmup_steps])
train_criterion = SoftTargetCrossEntropy()
val_criterion = nn.CrossEntropyLoss(label_smoothing=smoothing)

mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1) * 255
std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1) * 255

for step in range(steps):
    model.train()
    # uint8 images as a decoder would give them, normalized on the GPU
    images = torch.randint(0, 256, (batch_size, 3, img_size, img_size), dtype=torch.uint8).pin_memory()
    labels = torch.randint(0, num_classes, (batch_size,))
    images = images.to(device, non_blocking=True).float().sub_(mean).div_(std)
    labels = labels.to(device, non_blocking=True)
    images, soft_labels = mixup_cutmix(images, labels)

    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        logits = model(images)
        loss = train_criterion(logits, soft_labels)

    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()
    scheduler.step()
    model_ema.update_parameters(model)

    if step % 5 == 4:
        model_ema.eval()
        with torch.no_grad(), torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            ema_logits = model_ema(images[:16])
            ema_loss = val_criterion(ema_logits.float(), labels[:16])
        print(f"  ema eval loss {ema_loss.item():.4f}")
    print(f"step {step:2d} loss {loss.item():.4f} grad_norm {grad_norm.item():.3f} "
          f"lr {scheduler.get_last_lr()[0]:.2e} peak {torch.cuda.max_memory_allocated() / 1e9:.2f} GB")
