#!/usr/bin/env python
"""Sequence-to-sequence training with the Hugging Face Seq2SeqTrainer.

A self-contained variant of transformers' examples/pytorch/summarization/run_summarization.py:
a T5 built from a config (no pretrained weights) learns a toy "summarization" task on random
token ids (the target is every other source token, reversed: half as long), with dynamic padding by
`DataCollatorForSeq2Seq`, label smoothing, Adafactor, gradient checkpointing, and an
evaluation that generates. The SentencePiece-style tokenizer is built from a made-up
vocabulary, so it runs without network access.

    python hf_seq2seq_trainer.py                                  # tiny T5 (2 + 2 layers, 128 wide)
    python hf_seq2seq_trainer.py --d-model 512 --d-ff 2048 --num-layers 6 --num-heads 8 \
        --vocab-size 32128 --max-source-length 512 --max-target-length 256 --batch-size 16   # T5-small
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
    DataCollatorForSeq2Seq,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    T5Config,
    T5ForConditionalGeneration,
    T5Tokenizer,
    set_seed,
)
from transformers.utils import is_torch_bf16_gpu_available

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]


def build_tokenizer(vocab_size):
    """A T5 (unigram) tokenizer over a made-up vocabulary of `vocab_size` pieces, no sentinels."""
    vocab = [(tok, 0.0) for tok in SPECIAL_TOKENS]
    vocab += [(f"\u2581w{i}", -float(i)) for i in range(len(SPECIAL_TOKENS), vocab_size)]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


class RandomSummarizationDataset(Dataset):
    """Tokenized (document, summary) pairs of random lengths, as after run_summarization's preprocessing."""

    def __init__(self, tokenizer, num_samples, min_source_length, max_source_length, max_target_length, seed=0):
        rng = np.random.default_rng(seed)
        first = len(SPECIAL_TOKENS)
        self.examples = []
        for _ in range(num_samples):
            length = int(rng.integers(min_source_length, max_source_length))
            source = rng.integers(first, tokenizer.vocab_size, size=length - 1).tolist()
            target = source[::-2][: max_target_length - 1]
            self.examples.append(
                {
                    "input_ids": source + [tokenizer.eos_token_id],
                    "attention_mask": [1] * length,
                    "labels": target + [tokenizer.eos_token_id],
                }
            )

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def parse_args():
    parser = argparse.ArgumentParser(description="Train a T5 with the Seq2SeqTrainer")
    # model
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--d-ff", type=int, default=512)
    parser.add_argument("--d-kv", type=int, default=32)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    # data
    parser.add_argument("--min-source-length", type=int, default=32)
    parser.add_argument("--max-source-length", type=int, default=128)
    parser.add_argument("--max-target-length", type=int, default=64)
    parser.add_argument("--num-train-samples", type=int, default=256)
    parser.add_argument("--num-eval-samples", type=int, default=8)
    # training
    parser.add_argument("--output-dir", default=None, help="defaults to a temporary directory")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--eval-batch-size", type=int, default=4)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--eval-steps", type=int, default=5)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--num-beams", type=int, default=1)
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
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
    config = T5Config(
        vocab_size=args.vocab_size,
        d_model=args.d_model,
        d_ff=args.d_ff,
        d_kv=args.d_kv,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    model = T5ForConditionalGeneration(config)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(f"Training new model from scratch - Total size={n_params / 2**20:.2f}M params")

    train_dataset = RandomSummarizationDataset(
        tokenizer, args.num_train_samples, args.min_source_length, args.max_source_length,
        args.max_target_length, seed=args.seed,
    )
    eval_dataset = RandomSummarizationDataset(
        tokenizer, args.num_eval_samples, args.min_source_length, args.max_source_length,
        args.max_target_length, seed=args.seed + 1,
    )

    bf16 = is_torch_bf16_gpu_available()
    # As run_summarization.py: with the model, the collator also builds decoder_input_ids from the
    # labels, which label smoothing needs (the Trainer takes the labels away from the model).
    data_collator = DataCollatorForSeq2Seq(
        tokenizer,
        model=model,
        label_pad_token_id=-100,
        pad_to_multiple_of=8 if bf16 else None,
    )

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        if isinstance(preds, tuple):
            preds = preds[0]
        preds = np.where(preds != -100, preds, tokenizer.pad_token_id)
        labels = np.where(labels != -100, labels, tokenizer.pad_token_id)
        decoded_preds = tokenizer.batch_decode(preds, skip_special_tokens=True)
        decoded_labels = tokenizer.batch_decode(labels, skip_special_tokens=True)
        exact = np.mean([p.strip() == l.strip() for p, l in zip(decoded_preds, decoded_labels)])
        gen_len = np.mean([np.count_nonzero(p != tokenizer.pad_token_id) for p in preds])
        return {"exact_match": float(exact), "gen_len": float(gen_len)}

    output_dir = args.output_dir or tempfile.mkdtemp(prefix="hf_s2s_")
    training_args = Seq2SeqTrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.eval_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        optim="adafactor",
        label_smoothing_factor=args.label_smoothing,
        gradient_checkpointing=args.gradient_checkpointing,
        bf16=bf16,
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        predict_with_generate=True,
        generation_max_length=args.max_target_length,
        generation_num_beams=args.num_beams,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        seed=args.seed,
    )
    logger.info(f"Training/evaluation parameters {training_args}")

    trainer = Seq2SeqTrainer(
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

    metrics = trainer.evaluate(max_length=args.max_target_length, num_beams=args.num_beams, metric_key_prefix="eval")
    metrics["eval_samples"] = len(eval_dataset)
    trainer.log_metrics("eval", metrics)


if __name__ == "__main__":
    main()
