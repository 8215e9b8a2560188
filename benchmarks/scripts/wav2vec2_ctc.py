#!/usr/bin/env python
"""Wav2Vec2 CTC fine-tuning, as transformers' examples/pytorch/speech-recognition/
run_speech_recognition_ctc.py prepares it, with the Trainer's loop written out by hand.

A character vocabulary is written to vocab.json and loaded into a `Wav2Vec2CTCTokenizer`
(as the example builds it from the dataset's transcripts); a `Wav2Vec2FeatureExtractor`
normalizes each raw waveform, and `DataCollatorCTCWithPadding` pads the waveforms of a
batch to the longest one with an attention_mask and the labels with -100. The model is a
`Wav2Vec2ForCTC` built from a small `Wav2Vec2Config` (stable layer norm, as XLS-R and
wav2vec2-large-lv60 that take an attention mask; no pretrained weights), its convolutional
feature encoder frozen, SpecAugment on (mask_time_prob 0.05: the masks are drawn with
numpy in `_compute_mask_indices`).

The loop: fp16 autocast with a GradScaler, 2 micro-batches accumulated by hand, gradient
clipping, AdamW with a linear warmup schedule.

    python wav2vec2_ctc.py                              # 10 optimizer steps, 16 clips of 2-6 s
    python wav2vec2_ctc.py --hidden-size 768 --num-layers 12 --num-heads 12 --intermediate-size 3072
"""

import argparse
import json
import os
import random
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from transformers import (
    Wav2Vec2Config,
    Wav2Vec2CTCTokenizer,
    Wav2Vec2FeatureExtractor,
    Wav2Vec2ForCTC,
    Wav2Vec2Processor,
    get_linear_schedule_with_warmup,
)

CHARS = list("abcdefghijklmnopqrstuvwxyz'")


def parse_args():
    parser = argparse.ArgumentParser(description="Fine-tune Wav2Vec2 with CTC on random audio")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
    parser.add_argument("--per-device-batch-size", type=int, default=16)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--min-seconds", type=float, default=2.0)
    parser.add_argument("--max-seconds", type=float, default=6.0)
    parser.add_argument("--sampling-rate", type=int, default=16000)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--intermediate-size", type=int, default=1024)
    parser.add_argument("--mask-time-prob", type=float, default=0.05)
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--fp16", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def create_vocabulary(output_dir):
    """As the example's create_vocabulary_from_data: characters, '|' for the word delimiter,
    [UNK] and [PAD]."""
    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab["|"] = len(vocab)
    vocab["[UNK]"] = len(vocab)
    vocab["[PAD]"] = len(vocab)
    path = os.path.join(output_dir, "vocab.json")
    with open(path, "w") as f:
        json.dump(vocab, f)
    return path


class RandomSpeechDataset(Dataset):
    """Like the example's vectorized dataset after `prepare_dataset`: per clip the feature
    extractor's `input_values` (a normalized 1-D float array of its own length) and the
    tokenizer's `labels` of its transcript."""

    def __init__(self, processor, num_samples, min_seconds, max_seconds, sampling_rate, seed=0):
        rng = np.random.default_rng(seed)
        self.examples = []
        for _ in range(num_samples):
            seconds = rng.uniform(min_seconds, max_seconds)
            n = int(seconds * sampling_rate)
            audio = (0.1 * rng.standard_normal(n)).astype(np.float32)
            # about 12 characters per second of speech, in words of 2-8 letters
            words, length = [], 0
            while length < int(seconds * 12):
                w = "".join(rng.choice(CHARS[:-1], size=int(rng.integers(2, 9))))
                words.append(w)
                length += len(w) + 1
            text = " ".join(words)
            input_values = processor(audio, sampling_rate=sampling_rate).input_values[0]
            labels = processor(text=text).input_ids
            self.examples.append({"input_values": input_values, "labels": labels, "input_length": n})

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


@dataclass
class DataCollatorCTCWithPadding:
    """The example's collator: pads input_values (with an attention_mask) and labels,
    labels padded with -100 so the CTC loss ignores them."""

    processor: Wav2Vec2Processor
    padding: bool | str = "longest"
    pad_to_multiple_of: int | None = None
    pad_to_multiple_of_labels: int | None = None

    def __call__(self, features):
        input_features = [{"input_values": feature["input_values"]} for feature in features]
        label_features = [{"input_ids": feature["labels"]} for feature in features]

        batch = self.processor.pad(
            input_features,
            padding=self.padding,
            pad_to_multiple_of=self.pad_to_multiple_of,
            return_tensors="pt",
        )
        labels_batch = self.processor.pad(
            labels=label_features,
            padding=self.padding,
            pad_to_multiple_of=self.pad_to_multiple_of_labels,
            return_tensors="pt",
        )
        # replace padding with -100 to ignore loss correctly
        labels = labels_batch["input_ids"].masked_fill(labels_batch.attention_mask.ne(1), -100)
        batch["labels"] = labels
        if "attention_mask" in batch:
            batch["attention_mask"] = batch["attention_mask"].to(torch.long)
        return batch


def main():
    args = parse_args()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    device = "cuda"

    with tempfile.TemporaryDirectory(prefix="w2v2_ctc_") as tmpdir:  # the example's output_dir
        vocab_file = create_vocabulary(tmpdir)
        tokenizer = Wav2Vec2CTCTokenizer(
            vocab_file, unk_token="[UNK]", pad_token="[PAD]", word_delimiter_token="|"
        )
    feature_extractor = Wav2Vec2FeatureExtractor(
        feature_size=1,
        sampling_rate=args.sampling_rate,
        padding_value=0.0,
        do_normalize=True,
        return_attention_mask=True,  # feat_extract_norm == "layer"
    )
    processor = Wav2Vec2Processor(feature_extractor=feature_extractor, tokenizer=tokenizer)

    config = Wav2Vec2Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        intermediate_size=args.intermediate_size,
        feat_extract_norm="layer",
        do_stable_layer_norm=True,
        conv_bias=True,
        hidden_dropout=0.0,
        activation_dropout=0.0,
        attention_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
        layerdrop=0.0,
        mask_time_prob=args.mask_time_prob,
        mask_time_length=10,
        mask_feature_prob=0.0,
        ctc_loss_reduction="mean",
        ctc_zero_infinity=True,
        add_adapter=False,
    )
    model = Wav2Vec2ForCTC(config)
    model.freeze_feature_encoder()
    model.to(device)
    model.train()

    n_micro = args.steps * args.gradient_accumulation_steps
    train_dataset = RandomSpeechDataset(
        processor, n_micro * args.per_device_batch_size, args.min_seconds, args.max_seconds,
        args.sampling_rate, seed=args.seed,
    )
    data_collator = DataCollatorCTCWithPadding(processor=processor)
    train_dataloader = DataLoader(
        train_dataset, batch_size=args.per_device_batch_size, shuffle=True, collate_fn=data_collator,
    )

    decay_parameters = [n for n, p in model.named_parameters() if "bias" not in n and "layer_norm" not in n]
    optimizer_grouped_parameters = [
        {
            "params": [p for n, p in model.named_parameters() if n in decay_parameters and p.requires_grad],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if n not in decay_parameters and p.requires_grad],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-8)
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, args.steps)
    scaler = torch.amp.GradScaler("cuda", enabled=args.fp16)

    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"Wav2Vec2ForCTC: {n_params / 1e6:.2f}M parameters, {n_train / 1e6:.2f}M trainable")

    completed_steps = 0
    start = time.time()
    for step, batch in enumerate(train_dataloader):
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
            outputs = model(**batch)
            loss = outputs.loss / args.gradient_accumulation_steps
        scaler.scale(loss).backward()

        if (step + 1) % args.gradient_accumulation_steps == 0:
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            scale_before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() >= scale_before:  # the step was not skipped for inf/nan gradients
                lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            completed_steps += 1
            print(
                f"step {completed_steps}: loss {loss.item() * args.gradient_accumulation_steps:.4f} "
                f"grad_norm {grad_norm.item():.3f} lr {lr_scheduler.get_last_lr()[0]:.2e} "
                f"scale {scaler.get_scale():.0f} batch {tuple(batch['input_values'].shape)}"
            )
            if completed_steps >= args.steps:
                break

    elapsed = time.time() - start
    if torch.cuda.is_available():
        print(f"peak allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
    print(f"done: {completed_steps} steps in {elapsed:.1f}s")


if __name__ == "__main__":
    main()
