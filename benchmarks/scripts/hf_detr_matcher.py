#!/usr/bin/env python
"""DETR object detection with Hugging Face transformers, in the style of
examples/pytorch/object-detection/run_object_detection_no_trainer.py.

The model is a `DetrForObjectDetection` built from a `DetrConfig` with a ResNet-18-like
backbone from a locally built `ResNetConfig` (no timm, no pretrained weights). Images of
different sizes are padded to the largest in the batch the way `DetrImageProcessor.pad`
does, with a `pixel_mask` marking real pixels; the labels are a list of dicts, one per
image, with `class_labels` and normalized (cx, cy, w, h) `boxes` and a different number
of boxes per image. The loss uses DETR's Hungarian matcher, which moves the cost matrices
to the CPU and calls scipy.optimize.linear_sum_assignment.

AdamW with a lower learning rate for the backbone (as in the DETR recipe), gradient
clipping with clip_grad_norm_, optional autocast.

    python hf_detr_matcher.py                     # 10 steps, batch 8, images up to 512
    python hf_detr_matcher.py --mixed-precision bf16 --batch-size 16
"""

import argparse
import math
import random
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from transformers import DetrConfig, DetrForObjectDetection, ResNetConfig, get_scheduler


def parse_args():
    parser = argparse.ArgumentParser(description="Train DETR from scratch on random images")
    parser.add_argument("--steps", type=int, default=10, help="number of optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--min-size", type=int, default=384)
    parser.add_argument("--max-size", type=int, default=512)
    parser.add_argument("--max-boxes", type=int, default=20)
    parser.add_argument("--num-labels", type=int, default=91)
    parser.add_argument("--num-queries", type=int, default=50)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--backbone-learning-rate", type=float, default=1e-5)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--max-grad-norm", type=float, default=0.1)
    parser.add_argument("--freeze-backbone", action="store_true",
                        help="keep transformers' freezing (which, with an HF ResNet, freezes all of it)")
    parser.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"], default="no")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


class RandomDetectionDataset(Dataset):
    """What the example's `train_transforms` + `format_image_annotations_as_coco` + the
    image processor give per image: a normalized CHW float image of its own size and a
    dict of `class_labels` and normalized (cx, cy, w, h) `boxes`."""

    def __init__(self, num_samples, min_size, max_size, max_boxes, num_labels, seed=0):
        self.rng = np.random.default_rng(seed)
        self.items = []
        for idx in range(num_samples):
            h = int(self.rng.integers(min_size, max_size + 1))
            w = int(self.rng.integers(min_size, max_size + 1))
            n = int(self.rng.integers(1, max_boxes + 1))
            cxcy = self.rng.uniform(0.1, 0.9, size=(n, 2))
            wh = self.rng.uniform(0.05, 0.3, size=(n, 2))
            boxes = np.concatenate([cxcy, wh], axis=1).astype(np.float32)
            labels = self.rng.integers(0, num_labels, size=n).astype(np.int64)
            self.items.append((h, w, boxes, labels, idx))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        h, w, boxes, labels, idx = self.items[i]
        pixel_values = torch.randn(3, h, w)
        target = {
            "image_id": torch.tensor([idx]),
            "class_labels": torch.from_numpy(labels),
            "boxes": torch.from_numpy(boxes),
            "orig_size": torch.tensor([h, w]),
            "size": torch.tensor([h, w]),
        }
        return {"pixel_values": pixel_values, "labels": target}


def collate_fn(batch):
    """Pads to the largest height and width in the batch like DetrImageProcessor.pad."""
    max_h = max(x["pixel_values"].shape[1] for x in batch)
    max_w = max(x["pixel_values"].shape[2] for x in batch)
    pixel_values = torch.zeros(len(batch), 3, max_h, max_w)
    pixel_mask = torch.zeros(len(batch), max_h, max_w, dtype=torch.long)
    for i, x in enumerate(batch):
        _, h, w = x["pixel_values"].shape
        pixel_values[i, :, :h, :w] = x["pixel_values"]
        pixel_mask[i, :h, :w] = 1
    return {
        "pixel_values": pixel_values,
        "pixel_mask": pixel_mask,
        "labels": [x["labels"] for x in batch],
    }


def build_model(args):
    backbone_config = ResNetConfig(
        num_channels=3,
        embedding_size=64,
        hidden_sizes=[64, 128, 256, 512],
        depths=[2, 2, 2, 2],
        layer_type="basic",
        hidden_act="relu",
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    id2label = {i: f"class_{i}" for i in range(args.num_labels)}
    config = DetrConfig(
        use_timm_backbone=False,
        use_pretrained_backbone=False,
        backbone_config=backbone_config,
        num_queries=args.num_queries,
        d_model=args.d_model,
        encoder_layers=args.layers,
        decoder_layers=args.layers,
        encoder_attention_heads=8,
        decoder_attention_heads=8,
        encoder_ffn_dim=4 * args.d_model,
        decoder_ffn_dim=4 * args.d_model,
        auxiliary_loss=False,
        id2label=id2label,
        label2id={v: k for k, v in id2label.items()},
    )
    return DetrForObjectDetection(config)


def main():
    args = parse_args()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    device = "cuda"

    model = build_model(args)
    if not args.freeze_backbone:
        # DetrConvEncoder means to train stages 2-4 but matches "stage.1"/"stage.2"/"stage.3",
        # which HF ResNet names "stages.N": unfreeze them as the DETR recipe does.
        for name, param in model.model.backbone.named_parameters():
            if "embedder" not in name and "stages.0" not in name:
                param.requires_grad_(True)
    model.to(device)
    model.train()

    dataset = RandomDetectionDataset(
        num_samples=args.batch_size * args.steps,
        min_size=args.min_size,
        max_size=args.max_size,
        max_boxes=args.max_boxes,
        num_labels=args.num_labels,
        seed=args.seed,
    )
    train_dataloader = DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, collate_fn=collate_fn, num_workers=0
    )

    # DETR recipe: the backbone trains with a 10x lower learning rate
    param_dicts = [
        {
            "params": [p for n, p in model.named_parameters() if "backbone" not in n and p.requires_grad],
        },
        {
            "params": [p for n, p in model.named_parameters() if "backbone" in n and p.requires_grad],
            "lr": args.backbone_learning_rate,
        },
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.learning_rate, weight_decay=args.weight_decay)
    lr_scheduler = get_scheduler(
        name="linear", optimizer=optimizer, num_warmup_steps=0, num_training_steps=args.steps
    )

    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"DETR: {n_params / 1e6:.2f}M parameters, {n_train / 1e6:.2f}M trainable")

    amp_dtype = {"no": None, "fp16": torch.float16, "bf16": torch.bfloat16}[args.mixed_precision]
    scaler = torch.amp.GradScaler("cuda", enabled=args.mixed_precision == "fp16")

    completed_steps = 0
    start = time.time()
    for batch in train_dataloader:
        pixel_values = batch["pixel_values"].to(device)
        pixel_mask = batch["pixel_mask"].to(device)
        labels = [{k: v.to(device) for k, v in t.items()} for t in batch["labels"]]

        with torch.autocast(device_type="cuda", dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            outputs = model(pixel_values=pixel_values, pixel_mask=pixel_mask, labels=labels)
            loss = outputs.loss

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        lr_scheduler.step()
        optimizer.zero_grad()

        completed_steps += 1
        loss_dict = {k: round(v.item(), 4) for k, v in outputs.loss_dict.items()}
        print(
            f"step {completed_steps}: loss {loss.item():.4f} grad_norm {grad_norm.item():.3f} "
            f"lr {lr_scheduler.get_last_lr()[0]:.2e} {loss_dict}"
        )
        if completed_steps >= args.steps:
            break

    elapsed = time.time() - start
    if torch.cuda.is_available():
        print(f"peak allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
    print(f"done: {completed_steps} steps in {elapsed:.1f}s")


if __name__ == "__main__":
    main()
