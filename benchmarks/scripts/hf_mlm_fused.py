#!/usr/bin/env python
# RoBERTa masked-LM pretraining with the HF Trainer (run_mlm.py style): DataCollatorForLanguageModeling, fused AdamW, gradient checkpointing, group_by_length, bf16, 2 micro-batches
"""Masked language model pretraining with the Hugging Face Trainer.

A self-contained variant of transformers' examples/pytorch/language-modeling/run_mlm.py
without `--line_by_line` grouping: a `RobertaForMaskedLM` is built from a small
`RobertaConfig` (no pretrained weights), the tokenizer is a `PreTrainedTokenizerFast`
over a WordLevel vocabulary built in code, and the "tokenized texts" are random
token-id lists of varied length. `DataCollatorForLanguageModeling` pads each batch
to its longest example and masks 15 % of the tokens; batches are grouped by length.

    python hf_mlm_fused.py                       # 6 layers, 512 wide, 16 x <=256 tokens
    python hf_mlm_fused.py --steps 4 --cpu       # float32 on the CPU
"""

import argparse
import inspect
import logging
import math
import sys
import tempfile

import numpy as np
import torch
from torch.utils.data import Dataset

import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    DataCollatorForLanguageModeling,
    PreTrainedTokenizerFast,
    RobertaConfig,
    RobertaForMaskedLM,
    Trainer,
    TrainingArguments,
    set_seed,
)

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def build_tokenizer(vocab_size):
    """A RoBERTa-like fast tokenizer over a made-up word-level vocabulary (no downloads)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i in range(len(SPECIAL_TOKENS), vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", vocab["<s>"]), ("</s>", vocab["</s>"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        sep_token="</s>",
        cls_token="<s>",
        unk_token="<unk>",
        pad_token="<pad>",
        mask_token="<mask>",
        model_max_length=512,
    )


class RandomTextDataset(Dataset):
    """Tokenized "texts" of random length, as `tokenize_function` in run_mlm.py leaves them:
    dicts of python lists (input_ids, attention_mask, special_tokens_mask)."""

    def __init__(self, tokenizer, num_samples, min_len, max_len, seed=0):
        rng = np.random.default_rng(seed)
        words = [f"w{i}" for i in range(len(SPECIAL_TOKENS), tokenizer.vocab_size)]
        self.examples = []
        for _ in range(num_samples):
            length = int(rng.integers(min_len, max_len - 1))
            text = " ".join(words[j] for j in rng.integers(0, len(words), size=length))
            enc = tokenizer(text, truncation=True, max_length=max_len, return_special_tokens_mask=True)
            self.examples.append(dict(enc))

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def parse_args():
    p = argparse.ArgumentParser(description="Pretrain a RoBERTa MLM from scratch with the HF Trainer")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (max_steps)")
    p.add_argument("--num-layers", type=int, default=6)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--intermediate-size", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--num-samples", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--gradient-accumulation-steps", type=int, default=2)
    p.add_argument("--learning-rate", type=float, default=6e-4)
    p.add_argument("--cpu", action="store_true", help="train on the CPU in float32 (no fused AdamW, no bf16)")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


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

    kwargs = dict(
        output_dir=tempfile.mkdtemp(prefix="mlm_out_"),
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        weight_decay=0.01,
        adam_beta2=0.98,
        adam_epsilon=1e-6,
        warmup_steps=2,
        optim="adamw_torch" if args.cpu else "adamw_torch_fused",
        gradient_checkpointing=True,
        bf16=not args.cpu,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        use_cpu=args.cpu,
        seed=args.seed,
    )
    # transformers < 5: group_by_length=True; transformers 5 renamed it to a sampling strategy.
    if "group_by_length" in inspect.signature(TrainingArguments).parameters:
        kwargs["group_by_length"] = True
    else:
        kwargs["train_sampling_strategy"] = "group_by_length"
    training_args = TrainingArguments(**kwargs)

    config = RobertaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_len + 2,
        type_vocab_size=1,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = RobertaForMaskedLM(config)
    # run_mlm.py: resize the embeddings if the tokenizer is bigger than the model's vocabulary
    embedding_size = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > embedding_size:
        model.resize_token_embeddings(len(tokenizer))
    n_params = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    logger.info(f"Training new model from scratch - Total size={n_params / 2**20:.2f}M params")

    train_dataset = RandomTextDataset(tokenizer, args.num_samples, args.min_len, args.max_len, seed=args.seed)

    pad_to_multiple_of_8 = training_args.fp16 or training_args.bf16
    data_collator = DataCollatorForLanguageModeling(
        tokenizer=tokenizer,
        mlm_probability=0.15,
        pad_to_multiple_of=8 if pad_to_multiple_of_8 else None,
    )

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        data_collator=data_collator,
    )
    train_result = trainer.train()
    metrics = train_result.metrics
    metrics["train_samples"] = len(train_dataset)
    try:
        metrics["perplexity"] = math.exp(metrics["train_loss"])
    except (KeyError, OverflowError):
        metrics["perplexity"] = float("inf")
    trainer.log_metrics("train", metrics)


if __name__ == "__main__":
    main()
