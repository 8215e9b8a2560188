#!/usr/bin/env python
"""LoRA fine-tuning of a BERT sequence classifier with a Trainer subclass that overrides
``compute_loss`` (focal loss with label smoothing), in the style of the many community
notebooks that do imbalanced text classification with the Hugging Face Trainer.

The model is built from ``BertConfig()`` (bert-base shape, random weights), the tokenizer
from a vocabulary file written on the fly, and the data are random token ids of varying
length padded by ``DataCollatorWithPadding``: nothing is downloaded, ``datasets`` is not used.

    python hf_trainer_custom_loss.py                     # bert-base, 32 x <=512, accum 2, bf16, LoRA r=8
    python hf_trainer_custom_loss.py --cpu --num-layers 2 --hidden-size 64 --num-heads 4 \
        --intermediate-size 128 --vocab-size 1000 --max-len 32 --batch-size 4
"""

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from peft import LoraConfig, TaskType, get_peft_model
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertTokenizerFast,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
    set_seed,
)


class RandomTextDataset(Dataset):
    """Tokenised 'sentences' of random length (no padding: the collator pads per batch)."""

    def __init__(self, num_samples, min_len, max_len, vocab_size, num_labels, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(min_len, max_len + 1, (num_samples,), generator=g).tolist()
        self.lengths[::4] = [max_len] * len(self.lengths[::4])  # long documents are common
        self.ids = [torch.randint(min(1000, vocab_size // 2), vocab_size, (n - 2,), generator=g).tolist() for n in self.lengths]
        # imbalanced labels: the reason one reaches for focal loss
        probs = torch.tensor([0.7] + [0.3 / (num_labels - 1)] * (num_labels - 1))
        self.labels = torch.multinomial(probs, num_samples, replacement=True, generator=g).tolist()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = [101] + self.ids[i] + [102]  # [CLS] ... [SEP]
        return {
            "input_ids": ids,
            "token_type_ids": [0] * len(ids),
            "attention_mask": [1] * len(ids),
            "labels": self.labels[i],
        }


def build_tokenizer(vocab_size):
    """A BERT WordPiece tokenizer over a synthetic vocabulary (pad=0, [CLS]=101, [SEP]=102)."""
    vocab = [f"[unused{i}]" for i in range(vocab_size)]
    vocab[0], vocab[100], vocab[101], vocab[102], vocab[103] = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
    d = tempfile.mkdtemp(prefix="vocab_")
    path = os.path.join(d, "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(vocab) + "\n")
    return BertTokenizerFast(vocab_file=path, do_lower_case=True)


class FocalLossTrainer(Trainer):
    """Trainer with a focal loss (gamma) on label-smoothed targets."""

    def __init__(self, *args, gamma=2.0, label_smoothing=0.1, class_weights=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.gamma = gamma
        self.label_smoothing = label_smoothing
        self.class_weights = class_weights

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.get("logits")
        num_labels = logits.size(-1)

        log_probs = F.log_softmax(logits.float(), dim=-1)
        with torch.no_grad():
            target = torch.full_like(log_probs, self.label_smoothing / (num_labels - 1))
            target.scatter_(1, labels.unsqueeze(1), 1.0 - self.label_smoothing)
        ce = -(target * log_probs).sum(dim=-1)
        pt = log_probs.gather(1, labels.unsqueeze(1)).squeeze(1).exp()
        loss = (1 - pt) ** self.gamma * ce
        if self.class_weights is not None:
            loss = loss * self.class_weights.to(loss.device)[labels]

        if num_items_in_batch is not None:
            loss = loss.sum() / num_items_in_batch
        else:
            loss = loss.mean()
        return (loss, outputs) if return_outputs else loss


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--num-heads", type=int, default=12)
    p.add_argument("--intermediate-size", type=int, default=3072)
    p.add_argument("--vocab-size", type=int, default=30522)
    p.add_argument("--num-labels", type=int, default=5)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--min-len", type=int, default=None, help="defaults to max-len // 2")
    p.add_argument("--num-samples", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--output-dir", default=None)
    p.add_argument("--cpu", action="store_true", help="tiny run on the CPU in fp32")
    return p.parse_args()


def main():
    args = parse_args()
    set_seed(0)

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

    lora = LoraConfig(
        task_type=TaskType.SEQ_CLS,
        r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        lora_dropout=0.1,
        target_modules=["query", "value"],
    )
    model = get_peft_model(model, lora)
    model.print_trainable_parameters()

    train_set = RandomTextDataset(
        args.num_samples, args.min_len or args.max_len // 2, args.max_len, args.vocab_size, args.num_labels
    )
    collator = DataCollatorWithPadding(tokenizer=tokenizer)

    training_args = TrainingArguments(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="focal_out_"),
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        learning_rate=2e-4,
        warmup_steps=1,
        weight_decay=0.01,
        bf16=not args.cpu,
        optim="adamw_torch_fused",
        max_steps=args.max_steps,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        dataloader_pin_memory=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        use_cpu=args.cpu,
    )

    trainer = FocalLossTrainer(
        model=model,
        args=training_args,
        train_dataset=train_set,
        data_collator=collator,
        gamma=2.0,
        label_smoothing=0.1,
    )
    result = trainer.train()
    print(result.metrics)


if __name__ == "__main__":
    main()
