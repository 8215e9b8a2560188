#!/usr/bin/env python
"""Semantic segmentation with SegFormer, in the manner of transformers'
examples/pytorch/semantic-segmentation/run_semantic_segmentation_no_trainer.py.

``SegformerForSemanticSegmentation`` is built from a mit-b0 sized ``SegformerConfig``
(hidden sizes 32/64/160/256, 150 ADE20k labels, no pretrained weights) and trained on
random 512x512 images whose label maps carry the ignore index 255
(``semantic_loss_ignore_index``) on their borders, as ADE20k's reduced labels do. The
model computes its loss itself: its logits (1/4 of the image) are upsampled to the
labels' size with ``nn.functional.interpolate`` inside the model, then cross-entropy.
Training runs through Accelerate (``Accelerator(mixed_precision="bf16",
gradient_accumulation_steps=2)``, ``accelerator.accumulate(model)``) with a
``get_scheduler("polynomial")`` learning rate, and every ``--eval-every`` steps an
evaluation upsamples the logits to the labels' size, takes the argmax and adds a
confusion matrix with ``torch.bincount`` (mean IoU from it).

    python hf_segformer.py                                    # 8 x 512 x 512, 2 micro-batches a step
    python hf_segformer.py --cpu --image-size 128 --batch-size 2 --steps 2
"""

import argparse
import math

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import SegformerConfig, SegformerForSemanticSegmentation, default_data_collator, get_scheduler


class RandomSegmentation(Dataset):
    """Images normalised as SegformerImageProcessor does, and label maps of ``num_labels``
    classes with an ignored (255) border of random width, as a random crop of a padded image has."""

    def __init__(self, n, image_size, num_labels, seed=0):
        self.n, self.size, self.num_labels = n, image_size, num_labels
        self.seed = seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 100_003 + i)
        pixel_values = torch.randn(3, self.size, self.size, generator=g)
        # blocky label maps (regions of one class), upsampled from a coarse grid
        coarse = torch.randint(0, self.num_labels, (1, 1, self.size // 32, self.size // 32), generator=g).float()
        labels = torch.nn.functional.interpolate(coarse, size=(self.size, self.size), mode="nearest")[0, 0].long()
        border = int(torch.randint(0, self.size // 8, (1,), generator=g))
        if border:
            labels[:border, :] = 255
            labels[:, -border:] = 255
        return {"pixel_values": pixel_values, "labels": labels}


def parse_args():
    p = argparse.ArgumentParser(description="Train SegFormer (mit-b0 sized) with Accelerate on random images")
    p.add_argument("--image-size", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8, help="per device, per micro-batch")
    p.add_argument("--eval-batch-size", type=int, default=8)
    p.add_argument("--gradient-accumulation-steps", type=int, default=2)
    p.add_argument("--num-labels", type=int, default=150)
    p.add_argument("--learning-rate", type=float, default=6e-5)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--num-warmup-steps", type=int, default=0)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--eval-every", type=int, default=5, help="optimizer steps between evaluations")
    p.add_argument("--eval-batches", type=int, default=2)
    p.add_argument("--mixed-precision", default="bf16", choices=["no", "fp16", "bf16"])
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def evaluate(model, eval_dataloader, accelerator, num_labels, ignore_index=255):
    model.eval()
    confusion = torch.zeros(num_labels, num_labels, dtype=torch.long, device=accelerator.device)
    for batch in eval_dataloader:
        with torch.no_grad():
            outputs = model(**batch)
        upsampled_logits = torch.nn.functional.interpolate(
            outputs.logits, size=batch["labels"].shape[-2:], mode="bilinear", align_corners=False
        )
        predictions = upsampled_logits.argmax(dim=1)
        predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
        mask = references != ignore_index
        confusion += torch.bincount(
            references[mask] * num_labels + predictions[mask], minlength=num_labels * num_labels
        ).reshape(num_labels, num_labels)
    model.train()
    intersection = confusion.diag().float()
    union = confusion.sum(0).float() + confusion.sum(1).float() - intersection
    present = union > 0
    iou = intersection[present] / union[present]
    accuracy = intersection.sum() / confusion.sum().clamp(min=1)
    return {"mean_iou": iou.mean().item() if iou.numel() else 0.0, "overall_accuracy": accuracy.item()}


def main():
    args = parse_args()
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        cpu=args.cpu,
    )
    set_seed(args.seed)

    config = SegformerConfig(
        num_channels=3,
        num_encoder_blocks=4,
        depths=[2, 2, 2, 2],
        sr_ratios=[8, 4, 2, 1],
        hidden_sizes=[32, 64, 160, 256],
        patch_sizes=[7, 3, 3, 3],
        strides=[4, 2, 2, 2],
        num_attention_heads=[1, 2, 5, 8],
        mlp_ratios=[4, 4, 4, 4],
        hidden_act="gelu",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.1,
        drop_path_rate=0.1,
        decoder_hidden_size=256,
        num_labels=args.num_labels,
        semantic_loss_ignore_index=255,
    )
    model = SegformerForSemanticSegmentation(config)

    n_train = args.batch_size * args.gradient_accumulation_steps * args.steps
    train_dataset = RandomSegmentation(n_train, args.image_size, args.num_labels, seed=0)
    eval_dataset = RandomSegmentation(args.eval_batch_size * args.eval_batches, args.image_size, args.num_labels, seed=1)
    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=default_data_collator,
                                  batch_size=args.batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator, batch_size=args.eval_batch_size)

    optimizer = torch.optim.AdamW(
        list(model.parameters()), lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-8,
        weight_decay=args.weight_decay,
    )

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.steps
    lr_scheduler = get_scheduler(
        name="polynomial",
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=max_train_steps * accelerator.num_processes,
    )

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    num_epochs = math.ceil(max_train_steps / num_update_steps_per_epoch)

    n_params = sum(p.numel() for p in model.parameters())
    accelerator.print(f"SegFormer: {n_params / 1e6:.2f}M parameters, {len(train_dataset)} images, "
                      f"{num_epochs} epoch(s), {max_train_steps} optimizer steps")

    completed_steps = 0
    for epoch in range(num_epochs):
        model.train()
        total_loss = 0.0
        for step, batch in enumerate(train_dataloader):
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                total_loss += loss.detach().float()
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

            if accelerator.sync_gradients:
                completed_steps += 1
                if completed_steps % 5 == 0 or completed_steps == 1:
                    accelerator.print(f"step {completed_steps}: loss {loss.item():.4f}, "
                                      f"lr {lr_scheduler.get_last_lr()[0]:.2e}")
                if args.eval_every > 0 and completed_steps % args.eval_every == 0:
                    metrics = evaluate(model, eval_dataloader, accelerator, args.num_labels)
                    accelerator.print(f"step {completed_steps}: mean_iou {metrics['mean_iou']:.4f}, "
                                      f"overall_accuracy {metrics['overall_accuracy']:.4f}")
            if completed_steps >= max_train_steps:
                break
        if completed_steps >= max_train_steps:
            break


if __name__ == "__main__":
    main()
