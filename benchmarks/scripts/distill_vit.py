# Knowledge distillation (DeiT / timm style, no timm): hand-written ViT student, frozen larger ViT teacher,
# fp16 autocast + GradScaler, SGD nesterov with no-decay param groups, warmup-cosine LambdaLR, hand mixup
import argparse
import math
import time
from functools import partial

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def get_args_parser():
    parser = argparse.ArgumentParser('DeiT-style distillation training', add_help=False)
    parser.add_argument('--batch-size', default=128, type=int)
    parser.add_argument('--epochs', default=1, type=int)
    parser.add_argument('--iters-per-epoch', default=8, type=int)

    # Model parameters
    parser.add_argument('--model', default='vit_small_patch16_224', type=str, metavar='MODEL')
    parser.add_argument('--teacher-model', default='vit_base_patch16_224', type=str, metavar='MODEL')
    parser.add_argument('--input-size', default=224, type=int, help='images input size')
    parser.add_argument('--nb-classes', default=1000, type=int)
    parser.add_argument('--drop-path', type=float, default=0.1, metavar='PCT', help='Drop path rate (default: 0.1)')

    # Optimizer parameters
    parser.add_argument('--lr', type=float, default=0.1, metavar='LR')
    parser.add_argument('--momentum', type=float, default=0.9, metavar='M')
    parser.add_argument('--weight-decay', type=float, default=5e-5)
    parser.add_argument('--clip-grad', type=float, default=5.0, metavar='NORM')
    parser.add_argument('--warmup-epochs', type=float, default=0.25, metavar='N')
    parser.add_argument('--min-lr', type=float, default=1e-5, metavar='LR')

    # Augmentation / regularization
    parser.add_argument('--smoothing', type=float, default=0.1, help='Label smoothing (default: 0.1)')
    parser.add_argument('--mixup', type=float, default=0.8, help='mixup alpha, mixup enabled if > 0.')

    # Distillation parameters
    parser.add_argument('--distillation-alpha', default=0.5, type=float)
    parser.add_argument('--distillation-tau', default=1.0, type=float)

    parser.add_argument('--no-amp', action='store_false', dest='amp')
    parser.add_argument('--device', default='cuda', help='device to use for training / testing')
    parser.add_argument('--seed', default=0, type=int)
    return parser


def drop_path(x, drop_prob: float = 0., training: bool = False, scale_by_keep: bool = True):
    """Drop paths (Stochastic Depth) per sample (when applied in main path of residual blocks)."""
    if drop_prob == 0. or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)  # work with diff dim tensors, not just 2D ConvNets
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0 and scale_by_keep:
        random_tensor.div_(keep_prob)
    return x * random_tensor


class DropPath(nn.Module):
    """Drop paths (Stochastic Depth) per sample  (when applied in main path of residual blocks)."""
    def __init__(self, drop_prob: float = 0., scale_by_keep: bool = True):
        super(DropPath, self).__init__()
        self.drop_prob = drop_prob
        self.scale_by_keep = scale_by_keep

    def forward(self, x):
        return drop_path(x, self.drop_prob, self.training, self.scale_by_keep)

    def extra_repr(self):
        return f'drop_prob={round(self.drop_prob,3):0.3f}'


class PatchEmbed(nn.Module):
    """ 2D Image to Patch Embedding """
    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768):
        super().__init__()
        self.img_size = (img_size, img_size)
        self.patch_size = (patch_size, patch_size)
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        x = self.proj(x)
        x = x.flatten(2).transpose(1, 2)  # NCHW -> NLC
        return x


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, drop=0.):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_features, out_features)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x):
        x = self.fc1(x)
        x = self.act(x)
        x = self.drop1(x)
        x = self.fc2(x)
        x = self.drop2(x)
        return x


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False, attn_drop=0., proj_drop=0.):
        super().__init__()
        assert dim % num_heads == 0, 'dim should be divisible by num_heads'
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5

        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(
            q, k, v,
            dropout_p=self.attn_drop.p if self.training else 0.,
        )
        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4., qkv_bias=False, proj_drop=0., attn_drop=0.,
                 drop_path=0., act_layer=nn.GELU, norm_layer=nn.LayerNorm):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x):
        x = x + self.drop_path1(self.attn(self.norm1(x)))
        x = x + self.drop_path2(self.mlp(self.norm2(x)))
        return x


class VisionTransformer(nn.Module):
    """ Vision Transformer, a trimmed copy of timm's """
    def __init__(self, img_size=224, patch_size=16, in_chans=3, num_classes=1000, embed_dim=768, depth=12,
                 num_heads=12, mlp_ratio=4., qkv_bias=True, drop_rate=0., attn_drop_rate=0., drop_path_rate=0.,
                 norm_layer=None, act_layer=None):
        super().__init__()
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
        act_layer = act_layer or nn.GELU
        self.num_classes = num_classes
        self.num_features = self.embed_dim = embed_dim

        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim)
        num_patches = self.patch_embed.num_patches

        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, embed_dim) * .02)
        self.pos_drop = nn.Dropout(p=drop_rate)

        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]  # stochastic depth decay rule
        self.blocks = nn.Sequential(*[
            Block(dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                  proj_drop=drop_rate, attn_drop=attn_drop_rate, drop_path=dpr[i],
                  norm_layer=norm_layer, act_layer=act_layer)
            for i in range(depth)])
        self.norm = norm_layer(embed_dim)
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()

        nn.init.trunc_normal_(self.pos_embed, std=.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        self.apply(self._init_weights)

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.zeros_(m.bias)
            nn.init.ones_(m.weight)

    @torch.jit.ignore
    def no_weight_decay(self):
        return {'pos_embed', 'cls_token'}

    def forward_features(self, x):
        x = self.patch_embed(x)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = self.pos_drop(x + self.pos_embed)
        x = self.blocks(x)
        x = self.norm(x)
        return x

    def forward_head(self, x):
        x = x[:, 0]
        return self.head(x)

    def forward(self, x):
        x = self.forward_features(x)
        x = self.forward_head(x)
        return x


def vit_tiny_patch16_224(**kwargs):
    return VisionTransformer(patch_size=16, embed_dim=192, depth=12, num_heads=3, **kwargs)


def vit_small_patch16_224(**kwargs):
    return VisionTransformer(patch_size=16, embed_dim=384, depth=12, num_heads=6, **kwargs)


def vit_base_patch16_224(**kwargs):
    return VisionTransformer(patch_size=16, embed_dim=768, depth=12, num_heads=12, **kwargs)


def vit_large_patch16_224(**kwargs):
    return VisionTransformer(patch_size=16, embed_dim=1024, depth=24, num_heads=16, **kwargs)


_models = {
    'vit_tiny_patch16_224': vit_tiny_patch16_224,
    'vit_small_patch16_224': vit_small_patch16_224,
    'vit_base_patch16_224': vit_base_patch16_224,
    'vit_large_patch16_224': vit_large_patch16_224,
}


def create_model(name, **kwargs):
    return _models[name](**kwargs)


def param_groups_weight_decay(model, weight_decay=1e-5, no_weight_decay_list=()):
    no_weight_decay_list = set(no_weight_decay_list)
    decay = []
    no_decay = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue

        if param.ndim <= 1 or name.endswith(".bias") or name in no_weight_decay_list:
            no_decay.append(param)
        else:
            decay.append(param)

    return [
        {'params': no_decay, 'weight_decay': 0.},
        {'params': decay, 'weight_decay': weight_decay}]


class DistillationLoss(torch.nn.Module):
    """
    This module wraps a standard criterion and adds an extra knowledge distillation loss by
    taking a teacher model prediction and using it as additional supervision.
    """
    def __init__(self, base_criterion, teacher_model, alpha, tau):
        super().__init__()
        self.base_criterion = base_criterion
        self.teacher_model = teacher_model
        self.alpha = alpha
        self.tau = tau

    def forward(self, inputs, outputs, labels_a, labels_b, lam):
        base_loss = lam * self.base_criterion(outputs, labels_a) + (1 - lam) * self.base_criterion(outputs, labels_b)
        if self.alpha == 0:
            return base_loss

        # don't backprop throught the teacher
        with torch.no_grad():
            teacher_outputs = self.teacher_model(inputs)

        T = self.tau
        distillation_loss = F.kl_div(
            F.log_softmax(outputs / T, dim=1),
            F.log_softmax(teacher_outputs / T, dim=1),
            reduction='batchmean',
            log_target=True
        ) * (T * T)

        loss = base_loss * (1 - self.alpha) + distillation_loss * self.alpha
        return loss


def mixup_data(x, y, alpha=1.0):
    '''Returns mixed inputs, pairs of targets, and lambda'''
    if alpha > 0:
        lam = np.random.beta(alpha, alpha)
    else:
        lam = 1
    batch_size = x.size()[0]
    index = torch.randperm(batch_size, device=x.device)
    mixed_x = lam * x + (1 - lam) * x[index, :]
    y_a, y_b = y, y[index]
    return mixed_x, y_a, y_b, lam


def synthetic_loader(args):
    # stands in for an ImageFolder DataLoader: normalized uint8 images, random labels
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    for _ in range(args.iters_per_epoch):
        images = torch.randint(0, 256, (args.batch_size, 3, args.input_size, args.input_size), dtype=torch.uint8)
        images = (images.float() / 255. - mean) / std
        targets = torch.randint(0, args.nb_classes, (args.batch_size,))
        yield images, targets


def train_one_epoch(model, criterion, data_loader, optimizer, lr_scheduler, device, epoch, loss_scaler, args):
    model.train(True)
    start = time.time()
    for it, (samples, targets) in enumerate(data_loader):
        samples = samples.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        targets = targets.to(device, non_blocking=True)

        samples, targets_a, targets_b, lam = mixup_data(samples, targets, args.mixup)

        with torch.amp.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            outputs = model(samples)
            loss = criterion(samples, outputs, targets_a, targets_b, lam)

        loss_value = loss.item()
        if not math.isfinite(loss_value):
            print("Loss is {}, skipping".format(loss_value))

        optimizer.zero_grad(set_to_none=True)
        loss_scaler.scale(loss).backward()
        loss_scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        loss_scaler.step(optimizer)
        loss_scaler.update()
        lr_scheduler.step()

        if device.type == 'cuda':
            torch.cuda.synchronize()
        print(f"Epoch: [{epoch}] [{it}/{args.iters_per_epoch}] loss: {loss_value:.4f} "
              f"grad_norm: {grad_norm.item():.3f} lr: {optimizer.param_groups[0]['lr']:.6f} "
              f"time: {time.time() - start:.2f}s")


def main(args):
    print(args)
    device = torch.device(args.device)

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True

    print(f"Creating model: {args.model}")
    model = create_model(args.model, num_classes=args.nb_classes, drop_path_rate=args.drop_path,
                         img_size=args.input_size)
    model.to(device)
    model = model.to(memory_format=torch.channels_last)
    n_parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print('number of params:', n_parameters)

    print(f"Creating teacher model: {args.teacher_model}")
    teacher_model = create_model(args.teacher_model, num_classes=args.nb_classes, img_size=args.input_size)
    # a real run would load a fine-tuned checkpoint here: teacher_model.load_state_dict(checkpoint['model'])
    teacher_model.to(device)
    teacher_model.eval()

    parameters = param_groups_weight_decay(model, args.weight_decay, model.no_weight_decay())
    optimizer = torch.optim.SGD(parameters, lr=args.lr, momentum=args.momentum, nesterov=True)
    loss_scaler = torch.amp.GradScaler("cuda", enabled=args.amp)

    total_steps = args.epochs * args.iters_per_epoch
    warmup_steps = int(args.warmup_epochs * args.iters_per_epoch)

    def lr_lambda(step):
        if step < warmup_steps:
            return float(step + 1) / float(max(1, warmup_steps))
        progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
        return max(args.min_lr / args.lr, 0.5 * (1. + math.cos(math.pi * progress)))
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    base_criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.smoothing)
    criterion = DistillationLoss(base_criterion, teacher_model, args.distillation_alpha, args.distillation_tau)

    print(f"Start training for {args.epochs} epochs")
    start_time = time.time()
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, synthetic_loader(args), optimizer, lr_scheduler, device, epoch,
                        loss_scaler, args)
    total_time = time.time() - start_time
    print('Training time {:.1f}s'.format(total_time))
    if device.type == 'cuda':
        print('max memory allocated {:.2f} GiB, reserved {:.2f} GiB'.format(
            torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30))


if __name__ == '__main__':
    parser = argparse.ArgumentParser('DeiT training and evaluation script', parents=[get_args_parser()])
    args = parser.parse_args()
    main(args)
