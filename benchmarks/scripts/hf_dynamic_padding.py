#!/usr/bin/env python
"""Sequence classification with the Hugging Face Trainer and dynamic padding.

A self-contained variant of transformers' examples/pytorch/text-classification/run_glue.py
with `--pad_to_max_length False`: every batch is padded by `DataCollatorWithPadding` to its
own longest sequence, and batches are grouped by length to keep the padding small. The
model is a BERT built from a config (no pretrained weights), the tokenizer is built from a
word-piece vocabulary written on the fly, and the "sentences" are random token ids of
random lengths, so it runs without network access.

    python hf_dynamic_padding.py                                        # 4-layer BERT, 256 wide
    python hf_dynamic_padding.py --hidden-size 768 --num-layers 12 --num-heads 12 \
        --intermediate-size 3072 --max-len 512 --batch-size 32            # BERT-base
"""

import argparse
import logging
import sys
import tempfile

import numpy as np
import torch
from torch.utils.data import Dataset

import transformers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
    set_seed,
)
from transformers.utils import is_torch_bf16_gpu_available

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def build_tokenizer(vocab_size):
    """A BERT word-piece tokenizer over a made-up vocabulary of `vocab_size` entries."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i in range(len(SPECIAL_TOKENS), vocab_size):
        vocab[f"w{i}"] = i
    return BertTokenizer(vocab=vocab)


class RandomSentenceDataset(Dataset):
    """Tokenized "sentences" of random length: [CLS] w ... w [SEP], with a binary label.

    Like a tokenized GLUE split before collation: lists of ids of different lengths."""

    def __init__(self, tokenizer, num_samples, min_len, max_len, num_labels, seed=0):
        rng = np.random.default_rng(seed)
        n_special = len(SPECIAL_TOKENS)
        self.examples = []
        for _ in range(num_samples):
            length = int(rng.integers(min_len, max_len - 1))
            words = rng.integers(n_special, tokenizer.vocab_size, size=length).tolist()
            input_ids = [tokenizer.cls_token_id] + words + [tokenizer.sep_token_id]
            self.examples.append(
                {
                    "input_ids": input_ids,
                    "token_type_ids": [0] * len(input_ids),
                    "attention_mask": [1] * len(input_ids),
                    "label": int(rng.integers(0, num_labels)),
                }
            )

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def compute_metrics(eval_pred):
    logits, labels = eval_pred
    preds = np.argmax(logits, axis=-1)
    return {"accuracy": float((preds == labels).mean())}


def parse_args():
    parser = argparse.ArgumentParser(description="Fine-tune a BERT classifier with dynamic padding")
    # model
    parser.add_argument("--vocab-size", type=int, default=30522)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--intermediate-size", type=int, default=1024)
    parser.add_argument("--num-labels", type=int, default=2)
    # data
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--num-train-samples", type=int, default=512)
    parser.add_argument("--num-eval-samples", type=int, default=32)
    # training
    parser.add_argument("--output-dir", default=None, help="defaults to a temporary directory")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--eval-batch-size", type=int, default=16)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--eval-steps", type=int, default=5)
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def main():
    args = parse_args()

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    logger.setLevel(logging.INFO)
    transformers.utils.logging.set_verbosity_warning()

    set_seed(args.seed)

    tokenizer = build_tokenizer(args.vocab_size)
    config = BertConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=max(512, args.max_len),
        num_labels=args.num_labels,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = BertForSequenceClassification(config)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(f"Training new model from scratch - Total size={n_params / 2**20:.2f}M params")

    train_dataset = RandomSentenceDataset(
        tokenizer, args.num_train_samples, args.min_len, args.max_len, args.num_labels, seed=args.seed
    )
    eval_dataset = RandomSentenceDataset(
        tokenizer, args.num_eval_samples, args.min_len, args.max_len, args.num_labels, seed=args.seed + 1
    )

    # Pad each batch to its own longest sequence (run_glue.py without --pad_to_max_length).
    data_collator = DataCollatorWithPadding(tokenizer)

    output_dir = args.output_dir or tempfile.mkdtemp(prefix="hf_glue_")
    training_args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.eval_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        # `group_by_length=True` in transformers < 5.
        train_sampling_strategy="group_by_length",
        bf16=is_torch_bf16_gpu_available(),
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        seed=args.seed,
    )
    logger.info(f"Training/evaluation parameters {training_args}")

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=data_collator,
        compute_metrics=compute_metrics,
    )

    train_result = trainer.train()
    metrics = train_result.metrics
    metrics["train_samples"] = len(train_dataset)
    trainer.log_metrics("train", metrics)

    metrics = trainer.evaluate()
    metrics["eval_samples"] = len(eval_dataset)
    trainer.log_metrics("eval", metrics)


if __name__ == "__main__":
    main()
