"""Train a small FCOS/RetinaNet-style dense detection head with deformable convs.

Synthetic feature maps stand in for an FPN; targets are random one-hot class maps.
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.ops import DeformConv2d, StochasticDepth, sigmoid_focal_loss


class DeformBlock(nn.Module):
    def __init__(self, ch, drop_path=0.1, modulated=False):
        super().__init__()
        self.modulated = modulated  # DCNv2: a learnt mask per sampling point
        self.offset = nn.Conv2d(ch, (3 if modulated else 2) * 3 * 3, kernel_size=3, padding=1)
        nn.init.zeros_(self.offset.weight)
        nn.init.zeros_(self.offset.bias)
        self.dcn = DeformConv2d(ch, ch, kernel_size=3, padding=1)
        self.norm = nn.GroupNorm(32, ch)
        self.drop_path = StochasticDepth(drop_path, mode="row")

    def forward(self, x):
        off = self.offset(x)
        if self.modulated:
            o1, o2, m = off.chunk(3, dim=1)
            y = self.dcn(x, torch.cat((o1, o2), dim=1), m.sigmoid())
        else:
            y = self.dcn(x, off)
        y = F.relu(self.norm(y))
        return x + self.drop_path(y)


class DenseHead(nn.Module):
    def __init__(self, in_ch=256, num_classes=80, num_convs=4, num_anchors=1, modulated=False):
        super().__init__()
        self.cls_tower = nn.Sequential(*[DeformBlock(in_ch, 0.1 * i / num_convs, modulated) for i in range(num_convs)])
        self.box_tower = nn.Sequential(*[DeformBlock(in_ch, 0.1 * i / num_convs, modulated) for i in range(num_convs)])
        self.cls_logits = nn.Conv2d(in_ch, num_anchors * num_classes, 3, padding=1)
        self.bbox_pred = nn.Conv2d(in_ch, num_anchors * 4, 3, padding=1)
        prior = 0.01
        nn.init.constant_(self.cls_logits.bias, -torch.log(torch.tensor((1 - prior) / prior)).item())

    def forward(self, feats):
        cls_out, box_out = [], []
        for f in feats:
            cls_out.append(self.cls_logits(self.cls_tower(f)).flatten(2))
            box_out.append(F.relu(self.bbox_pred(self.box_tower(f))).flatten(2))
        return torch.cat(cls_out, dim=2), torch.cat(box_out, dim=2)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--channels", type=int, default=128)
    p.add_argument("--num-classes", type=int, default=80)
    p.add_argument("--image-size", type=int, default=384)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--modulated", action="store_true", help="DCNv2 (offsets and a mask)")
    args = p.parse_args()

    device = "cuda"
    torch.backends.cudnn.benchmark = True
    model = DenseHead(args.channels, args.num_classes, modulated=args.modulated).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    strides = [8, 16, 32, 64, 128]

    model.train()
    for step in range(args.steps):
        t0 = time.time()
        feats = [torch.randn(args.batch_size, args.channels, args.image_size // s, args.image_size // s, device=device)
                 for s in strides]
        n_loc = sum((args.image_size // s) ** 2 for s in strides)
        labels = torch.randint(0, args.num_classes + 1, (args.batch_size, n_loc), device=device)
        cls_t = F.one_hot(labels, args.num_classes + 1)[..., 1:].permute(0, 2, 1).float()
        box_t = torch.rand(args.batch_size, 4, n_loc, device=device) * 10
        pos = (labels > 0).unsqueeze(1)

        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            cls_logits, box_reg = model(feats)
        num_pos = max(pos.sum().item(), 1.0)
        loss_cls = sigmoid_focal_loss(cls_logits.float(), cls_t, alpha=0.25, gamma=2.0, reduction="sum") / num_pos
        loss_box = (F.smooth_l1_loss(box_reg.float(), box_t, reduction="none") * pos).sum() / num_pos
        loss = loss_cls + loss_box
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        scaler.step(optimizer)
        scaler.update()
        if step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f} cls {loss_cls.item():.4f} box {loss_box.item():.4f} "
                  f"({time.time() - t0:.2f}s)")


if __name__ == "__main__":
    main()
