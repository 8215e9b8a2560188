# Action recognition with torchvision's R3D-18 plus a small hand-written 3D conv stem ablation,
# GPU-side spatial augmentation with F.affine_grid + F.grid_sample on 5-D clips,
# legacy torch.cuda.amp.autocast / torch.cuda.amp.GradScaler, SGD + MultiStepLR.
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

torch.backends.cudnn.benchmark = True

NUM_CLASSES = 51  # HMDB-51
CLIP_LEN = 16
CROP = 112
BATCH = 16
EPOCH_STEPS = 8


class ClipDataset(torch.utils.data.Dataset):
    """Stands in for a decoded-video dataset: (C, T, H, W) uint8 clips at 128x171 like the Kinetics recipe."""

    def __len__(self):
        return 256

    def __getitem__(self, i):
        clip = torch.randint(0, 256, (3, CLIP_LEN, 128, 171), dtype=torch.uint8)
        return clip, i % NUM_CLASSES


def gpu_spatial_aug(clip, max_rot=10.0, scale=(0.8, 1.2)):
    """Per-clip random rotation+scale+translation of all frames alike, via a 3-D affine grid."""
    B = clip.shape[0]
    dev = clip.device
    ang = (torch.rand(B, device=dev) * 2 - 1) * math.radians(max_rot)
    s = torch.empty(B, device=dev).uniform_(*scale)
    tx = (torch.rand(B, device=dev) * 2 - 1) * 0.1
    ty = (torch.rand(B, device=dev) * 2 - 1) * 0.1
    theta = torch.zeros(B, 3, 4, device=dev)
    theta[:, 0, 0] = torch.cos(ang) / s
    theta[:, 0, 1] = -torch.sin(ang) / s
    theta[:, 1, 0] = torch.sin(ang) / s
    theta[:, 1, 1] = torch.cos(ang) / s
    theta[:, 2, 2] = 1.0
    theta[:, 0, 3] = tx
    theta[:, 1, 3] = ty
    # grid is (B, T, H, W, 3) with (x, y, t) order; output resampled to the crop size
    grid = F.affine_grid(theta, size=(B, clip.shape[1], CLIP_LEN, CROP, CROP), align_corners=False)
    return F.grid_sample(clip, grid, mode="bilinear", padding_mode="reflection", align_corners=False)


def build_model():
    model = torchvision.models.video.r3d_18(weights=None)
    # replace the stem with a temporally wider (5,7,7) conv, as in some ablations
    model.stem = nn.Sequential(
        nn.Conv3d(3, 64, kernel_size=(5, 7, 7), stride=(1, 2, 2), padding=(2, 3, 3), bias=False),
        nn.BatchNorm3d(64),
        nn.ReLU(inplace=True),
    )
    model.fc = nn.Sequential(nn.Dropout(0.5), nn.Linear(model.fc.in_features, NUM_CLASSES))
    return model


def main():
    device = torch.device("cuda")
    model = build_model().cuda()
    criterion = nn.CrossEntropyLoss().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[4, 6], gamma=0.1)
    scaler = torch.cuda.amp.GradScaler()
    loader = torch.utils.data.DataLoader(ClipDataset(), batch_size=BATCH, shuffle=True, num_workers=0,
                                         pin_memory=True, drop_last=True)
    mean = torch.tensor([0.43216, 0.394666, 0.37645]).view(1, 3, 1, 1, 1).cuda()
    std = torch.tensor([0.22803, 0.22145, 0.216989]).view(1, 3, 1, 1, 1).cuda()

    model.train()
    end = time.time()
    for i, (video, target) in enumerate(loader):
        video = video.cuda(non_blocking=True).float().div_(255)
        target = target.cuda(non_blocking=True)
        video = (video - mean) / std
        video = gpu_spatial_aug(video)

        with torch.cuda.amp.autocast():
            output = model(video)
            loss = criterion(output, target)

        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 20.0)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()

        acc1 = (output.argmax(1) == target).float().mean() * 100
        print(f"[{i}/{EPOCH_STEPS}] loss {loss.item():.4f} acc@1 {acc1.item():.1f} "
              f"scale {scaler.get_scale():.0f} time {time.time() - end:.2f}s "
              f"mem {torch.cuda.memory_allocated(device) / 2**20:.0f}/{torch.cuda.max_memory_reserved(device) / 2**20:.0f} MiB")
        end = time.time()
        if i + 1 >= EPOCH_STEPS:
            break


if __name__ == "__main__":
    main()
