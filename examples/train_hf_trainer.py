#!/usr/bin/env python
"""Train a small GPT-2 from scratch with Hugging Face's Trainer, memprof tracking it and advising on it.

    python examples/train_hf_trainer.py --max-steps 6                                   # small, on this machine
    python examples/train_hf_trainer.py --max-steps 6 --target rtx3060 --budget 12GiB   # + plans as TrainingArguments
    python examples/train_hf_trainer.py --n-layer 12 --n-embd 768 --n-head 12 --seq-len 1024 --vocab-size 50257 \
        --per-device-train-batch-size 16 --bf16 --budget 24GiB                          # GPT-2 size, on a GPU

The model is built from a config (no download) and trained on random tokens.
MemprofTrainerCallback logs the memory by category through ``trainer.log``
(``memprof/parameters_GiB``, ``memprof/activations_GiB``, ... in the log
history and every ``--report-to`` integration), saves the report to
``<output_dir>/memprof.json``, and with ``--budget`` (or ``--advise --target``)
ranks the memory plans for this run's own step after the warm-up steps and
prints them as ``TrainingArguments`` settings. Every ``TrainingArguments``
option works as usual (``--gradient-accumulation-steps 2``, ``--bf16``, ...).
"""

import logging
from dataclasses import dataclass, field

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments, set_seed

from memprof.callbacks import MemprofTrainerCallback

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    n_layer: int = field(default=4, metadata={"help": "transformer blocks"})
    n_embd: int = field(default=128, metadata={"help": "hidden size"})
    n_head: int = field(default=4, metadata={"help": "attention heads"})
    vocab_size: int = field(default=4096, metadata={"help": "vocabulary size"})
    seq_len: int = field(default=128, metadata={"help": "tokens per sample (also the model's n_positions)"})


@dataclass
class MemprofArguments:
    budget: str | None = field(default=None, metadata={"help": "device memory per rank the plans must fit, e.g. 24GiB or rtx4090 (implies --advise)"})
    target: str | None = field(default=None, metadata={"help": "GPU of memprof's catalogue to simulate for the advice, e.g. rtx3060 or h100"})
    advise: bool = field(default=False, metadata={"help": "rank memory plans after the warm-up steps (needs --budget or --target)"})
    warmup: int = field(default=2, metadata={"help": "steps memprof profiles at the start"})
    every: int = field(default=2, metadata={"help": "then profile every N-th step (0: none)"})


class RandomTokens(Dataset):
    """Random token ids; the labels are the ids (the model shifts them for next-token prediction)."""

    def __init__(self, n: int, seq_len: int, vocab_size: int) -> None:
        self.ids = torch.randint(0, vocab_size, (n, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = HfArgumentParser((ModelArguments, MemprofArguments, TrainingArguments))
    # Defaults for a short demo run; any of them can be given on the command line.
    parser.set_defaults(output_dir="hf_trainer_memprof", max_steps=6, per_device_train_batch_size=8, logging_steps=1,
                        report_to="none", save_strategy="no", disable_tqdm=True)
    model_args, memprof_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    set_seed(training_args.seed)

    config = GPT2Config(n_layer=model_args.n_layer, n_embd=model_args.n_embd, n_head=model_args.n_head,
                        vocab_size=model_args.vocab_size, n_positions=model_args.seq_len, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    samples = training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps * max(
        training_args.max_steps, 1) * max(training_args.world_size, 1)
    train_dataset = RandomTokens(samples, model_args.seq_len, model_args.vocab_size)

    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset)
    # The callback takes the trainer: it logs through trainer.log and writes to training_args.output_dir.
    memprof_cb = MemprofTrainerCallback(
        trainer, warmup=memprof_args.warmup, every=memprof_args.every, advise=memprof_args.advise,
        budget=memprof_args.budget, target=memprof_args.target,
    )
    trainer.add_callback(memprof_cb)
    trainer.train()

    if trainer.is_world_process_zero():
        logger.info("memprof report: %s/memprof.json", training_args.output_dir)
        if memprof_cb.advice is not None:
            logger.info("best plan: %s: %s", memprof_cb.advice.best, "; ".join(memprof_cb.advice.settings()) or "no change")


if __name__ == "__main__":
    main()
