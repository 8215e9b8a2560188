# Mask R-CNN fine-tuning loop in the style of torchvision/references/detection
# (train_one_epoch + warmup LinearLR + AMP GradScaler), on a synthetic dataset.
import math
import sys
import time

import torch
import torchvision
from torch.utils.data import DataLoader, Dataset
from torchvision.models.detection import maskrcnn_resnet50_fpn
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.models.detection.mask_rcnn import MaskRCNNPredictor

NUM_CLASSES = 5  # background + 4
BATCH_SIZE = 4
NUM_STEPS = 8
IMG_SIZES = [(480, 640), (512, 512), (600, 800), (427, 640)]


class SyntheticCOCO(Dataset):
    """Random images with 1-6 random boxes and box-shaped instance masks."""

    def __init__(self, n=64):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        g = torch.Generator().manual_seed(idx)
        h, w = IMG_SIZES[idx % len(IMG_SIZES)]
        img = torch.rand(3, h, w, generator=g)
        n_obj = int(torch.randint(1, 7, (1,), generator=g))
        x1 = torch.rand(n_obj, generator=g) * (w - 64)
        y1 = torch.rand(n_obj, generator=g) * (h - 64)
        bw = 16 + torch.rand(n_obj, generator=g) * (w / 3)
        bh = 16 + torch.rand(n_obj, generator=g) * (h / 3)
        boxes = torch.stack([x1, y1, (x1 + bw).clamp(max=w - 1), (y1 + bh).clamp(max=h - 1)], dim=1)
        masks = torch.zeros(n_obj, h, w, dtype=torch.uint8)
        for i, b in enumerate(boxes.round().long().tolist()):
            masks[i, b[1]:b[3], b[0]:b[2]] = 1
        target = {
            "boxes": boxes,
            "labels": torch.randint(1, NUM_CLASSES, (n_obj,), generator=g),
            "masks": masks,
            "image_id": idx,
            "area": (boxes[:, 3] - boxes[:, 1]) * (boxes[:, 2] - boxes[:, 0]),
            "iscrowd": torch.zeros((n_obj,), dtype=torch.int64),
        }
        return img, target


def collate_fn(batch):
    return tuple(zip(*batch))


def get_model(num_classes):
    model = maskrcnn_resnet50_fpn(weights=None, weights_backbone=None)
    in_features = model.roi_heads.box_predictor.cls_score.in_features
    model.roi_heads.box_predictor = FastRCNNPredictor(in_features, num_classes)
    in_features_mask = model.roi_heads.mask_predictor.conv5_mask.in_channels
    model.roi_heads.mask_predictor = MaskRCNNPredictor(in_features_mask, 256, num_classes)
    return model


def main():
    device = torch.device("cuda")
    print("torchvision", torchvision.__version__, "device", device)

    dataset = SyntheticCOCO()
    data_loader = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True, num_workers=2,
                             collate_fn=collate_fn, pin_memory=True)

    model = get_model(NUM_CLASSES)
    model.to(device)
    model.train()

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.02, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cuda")

    warmup_factor = 1.0 / 1000
    warmup_iters = min(1000, len(data_loader) - 1)
    lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=warmup_factor, total_iters=warmup_iters)

    step = 0
    t0 = time.time()
    while step < NUM_STEPS:
        for images, targets in data_loader:
            images = list(image.to(device, non_blocking=True) for image in images)
            targets = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in t.items()} for t in targets]

            with torch.amp.autocast("cuda", enabled=True):
                loss_dict = model(images, targets)
                losses = sum(loss for loss in loss_dict.values())

            loss_value = losses.item()
            if not math.isfinite(loss_value):
                print(f"Loss is {loss_value}, stopping training")
                print(loss_dict)
                sys.exit(1)

            optimizer.zero_grad()
            scaler.scale(losses).backward()
            scaler.step(optimizer)
            scaler.update()
            lr_scheduler.step()

            parts = "  ".join(f"{k}: {v.item():.4f}" for k, v in loss_dict.items())
            print(f"step {step}  loss {loss_value:.4f}  {parts}  lr {optimizer.param_groups[0]['lr']:.6f}  "
                  f"max_mem {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
            step += 1
            if step >= NUM_STEPS:
                break
    print(f"done in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
