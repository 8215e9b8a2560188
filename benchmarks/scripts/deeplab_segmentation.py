# DeepLabV3-ResNet50 semantic segmentation in the style of torchvision/references/segmentation:
# aux loss, ignore_index=255, poly LR, per-group lr (x10 for aux head), channels_last, cudnn.benchmark,
# GPU-side random scale with F.interpolate (bilinear for images, nearest for masks) then random crop.
import random
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

torch.backends.cudnn.benchmark = True

NUM_CLASSES = 21
BATCH_SIZE = 8
BASE_SIZE = 520
CROP_SIZE = 480
ITERS = 8
LR = 0.02


def synthetic_batch(bs, size, num_classes):
    """A batch like VOC after RandomResize: float images in [0,1], int64 masks with 255 borders."""
    imgs = torch.rand(bs, 3, size, size)
    masks = torch.randint(0, num_classes, (bs, size, size), dtype=torch.int64)
    masks[:, :8, :] = 255
    masks[:, :, -8:] = 255
    return imgs, masks


def gpu_augment(image, target, crop_size):
    # random scale 0.5-2.0 of the whole batch, as RandomResize(min, max) would per sample
    scale = random.uniform(0.5, 2.0)
    size = int(BASE_SIZE * scale)
    image = F.interpolate(image, size=(size, size), mode="bilinear", align_corners=False)
    target = F.interpolate(target[:, None].float(), size=(size, size), mode="nearest")[:, 0].long()
    # pad with 0 / 255 if smaller than the crop
    if size < crop_size:
        pad = crop_size - size
        image = F.pad(image, (0, pad, 0, pad), value=0.0)
        target = F.pad(target, (0, pad, 0, pad), value=255)
        size = crop_size
    i = np.random.randint(0, size - crop_size + 1)
    j = np.random.randint(0, size - crop_size + 1)
    image = image[:, :, i:i + crop_size, j:j + crop_size]
    target = target[:, i:i + crop_size, j:j + crop_size]
    # horizontal flip of half of the batch
    flip = torch.rand(image.shape[0], device=image.device) < 0.5
    image = torch.where(flip[:, None, None, None], image.flip(-1), image)
    target = torch.where(flip[:, None, None], target.flip(-1), target)
    mean = torch.tensor([0.485, 0.456, 0.406], device=image.device).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], device=image.device).view(1, 3, 1, 1)
    image = (image - mean) / std
    return image.contiguous(memory_format=torch.channels_last), target


def criterion(inputs, target):
    losses = {}
    for name, x in inputs.items():
        losses[name] = nn.functional.cross_entropy(x, target, ignore_index=255)
    if len(losses) == 1:
        return losses["out"]
    return losses["out"] + 0.5 * losses["aux"]


def main():
    device = "cuda"
    model = torchvision.models.segmentation.deeplabv3_resnet50(
        weights=None, weights_backbone=None, num_classes=NUM_CLASSES, aux_loss=True)
    model = model.to(device).to(memory_format=torch.channels_last)

    params_to_optimize = [
        {"params": [p for p in model.backbone.parameters() if p.requires_grad]},
        {"params": [p for p in model.classifier.parameters() if p.requires_grad]},
        {"params": [p for p in model.aux_classifier.parameters() if p.requires_grad], "lr": LR * 10},
    ]
    optimizer = torch.optim.SGD(params_to_optimize, lr=LR, momentum=0.9, weight_decay=1e-4)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda x: (1 - x / ITERS) ** 0.9)
    scaler = torch.amp.GradScaler("cuda")

    model.train()
    t0 = time.time()
    for it in range(ITERS):
        image, target = synthetic_batch(BATCH_SIZE, BASE_SIZE, NUM_CLASSES)
        image = image.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        image, target = gpu_augment(image, target, CROP_SIZE)

        with torch.amp.autocast(device_type="cuda", dtype=torch.float16):
            output = model(image)
            loss = criterion(output, target)

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        lr_scheduler.step()

        with torch.no_grad():
            pred = output["out"].argmax(1)
            valid = target != 255
            acc = (pred[valid] == target[valid]).float().mean()
        print(f"it {it}  loss {loss.item():.4f}  pixacc {acc.item():.3f}  lr {lr_scheduler.get_last_lr()[0]:.5f}  "
              f"mem {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    print(f"{ITERS} iters in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
