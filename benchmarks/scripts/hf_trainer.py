#!/usr/bin/env python
"""Causal language model training with the Hugging Face Trainer.

A self-contained variant of transformers' examples/pytorch/language-modeling/run_clm.py:
the model is built from a GPT-2 config (no pretrained weights) and trained on random
token ids, so it runs without network access.

    python hf_trainer.py                                   # GPT-2 small, 8 x 512, bf16
    python hf_trainer.py --n-layer 2 --n-embd 64 --seq-len 32 --cpu
"""

import argparse
import logging
import sys
import tempfile

import torch
from torch.utils.data import Dataset

import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.utils import is_torch_bf16_gpu_available

logger = logging.getLogger(__name__)


class RandomTokenDataset(Dataset):
    """Fixed-length blocks of random token ids, like run_clm's grouped texts."""

    def __init__(self, num_samples, seq_len, vocab_size, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, vocab_size, (num_samples, seq_len), generator=generator)

    def __len__(self):
        return self.input_ids.size(0)

    def __getitem__(self, i):
        ids = self.input_ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def parse_args():
    parser = argparse.ArgumentParser(description="Train a causal LM from scratch with the HF Trainer")
    # model
    parser.add_argument("--model-type", default="gpt2", help="any config type AutoConfig.for_model knows")
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--seq-len", type=int, default=512)
    # data
    parser.add_argument("--num-samples", type=int, default=1024)
    # training
    parser.add_argument("--output-dir", default=None, help="defaults to a temporary directory")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--fp16", action="store_true", help="use fp16 mixed precision instead of bf16")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU in float32")
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

    # Mixed precision: bf16 where the GPU has it, fp16 otherwise (or when asked), none on the CPU.
    bf16 = fp16 = False
    if not args.cpu:
        if args.fp16 or not is_torch_bf16_gpu_available():
            fp16 = torch.cuda.is_available()
        else:
            bf16 = True

    output_dir = args.output_dir or tempfile.mkdtemp(prefix="hf_out_")
    training_args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        lr_scheduler_type="cosine",
        optim="adamw_torch",
        bf16=bf16,
        fp16=fp16,
        gradient_checkpointing=args.gradient_checkpointing,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        dataloader_num_workers=0,
        use_cpu=args.cpu,
        seed=args.seed,
    )
    logger.info(f"Training/evaluation parameters {training_args}")

    config = AutoConfig.for_model(
        args.model_type,
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        n_positions=max(1024, args.seq_len),
        vocab_size=args.vocab_size,
    )
    model = AutoModelForCausalLM.from_config(config)
    n_params = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    logger.info(f"Training new model from scratch - Total size={n_params / 2**20:.2f}M params")

    train_dataset = RandomTokenDataset(args.num_samples, args.seq_len, config.vocab_size, seed=args.seed)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        data_collator=default_data_collator,
    )

    train_result = trainer.train()
    metrics = train_result.metrics
    metrics["train_samples"] = len(train_dataset)
    trainer.log_metrics("train", metrics)
    trainer.save_state()


if __name__ == "__main__":
    main()
