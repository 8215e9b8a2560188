"""memprof inside Lightning and the Hugging Face Trainer, checked on the GPU.

For each trainer, two fits:

1. tracked by memprof's callback, which logs the memory by category at every
   step and advises for ``--budget``; a probe callback of this benchmark
   reads the allocator's own peak of every step (``reset_peak_memory_stats``
   at the batch's start, ``max_memory_allocated`` at its end) -- memprof
   leaves those counters as they would be without it, so the two can be
   compared step by step: the categories logged must sum to that peak;
2. the advice's best plan applied as the advice words it (Trainer settings,
   checkpointing of each block), without memprof: its measured peak against
   the predicted one, and whether it fits the budget.

    python3 benchmarks/trainer_advice.py --out benchmarks/results     # trainer-advice-{lightning,hf}.json: GPT-2 124M in Lightning, BERT-base in HF's Trainer
    python3 benchmarks/trainer_advice.py --small --out /tmp/x         # tiny models: the plumbing, on a CPU (no measurement)
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import sys
import warnings
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import memprof  # noqa: E402
from memprof.categories import ALLOCATED  # noqa: E402

GiB = 2**30
CATEGORIES = [c.value for c in ALLOCATED]


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return self.ids[i]


def plan_parts(strategies: list) -> dict:
    """A plan's strategies -> what to change: micro-batches, checkpointing, activation offload."""
    from memprof.strategies import Accumulation, ActivationOffload, Checkpointing

    out = {"accumulate": 1, "ckpt": False, "offload": False}
    for s in strategies:
        if isinstance(s, Accumulation):
            out["accumulate"] = s.k
        elif isinstance(s, Checkpointing) and not s.selective:
            out["ckpt"] = True
        elif isinstance(s, ActivationOffload):
            out["offload"] = True
        else:
            raise SystemExit(f"this benchmark cannot apply {s.name!r} (of {[x.name for x in strategies]})")
    return out


def checkpoint_blocks(blocks) -> None:
    """What the advice says for Lightning: ``block.forward = partial(checkpoint, block.forward, use_reentrant=False)``."""
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def step_peaks_check(logged: list[dict], probe: dict[int, int]) -> list[dict]:
    """Each profiled step: the categories logged, summed, against the probe's allocator peak."""
    rows = []
    for m in logged:
        step = int(m["step"])
        if step not in probe:
            continue
        total = sum(float(m.get(f"{c}_GiB", 0.0)) for c in CATEGORIES) * GiB
        rows.append({"step": step, "categories_sum": round(total), "allocator_peak": probe[step],
                     "error": total / probe[step] - 1})
    return rows


# -- Lightning -------------------------------------------------------------------------
def lightning_fits(args) -> dict:
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from transformers import GPT2Config, GPT2LMHeadModel

    from memprof.callbacks import MemprofCallback

    cfg = dict(n_layer=2, n_embd=128, n_head=4, vocab_size=1024, n_positions=128) if args.small else \
        dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    seq, batch = cfg["n_positions"], (4 if args.small else 16)

    class GPT2Module(L.LightningModule):
        def __init__(self, ckpt: bool = False, offload: bool = False) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT2LMHeadModel(GPT2Config(**cfg, bos_token_id=0, eos_token_id=0))
            self.ckpt, self.offload = ckpt, offload

        def configure_model(self) -> None:
            if self.ckpt:
                checkpoint_blocks(self.model.transformer.h)

        def training_step(self, ids, batch_idx):
            if self.offload:
                with torch.autograd.graph.save_on_cpu(pin_memory=True):
                    return self.model(input_ids=ids, labels=ids).loss
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    probe = Probe()

    class LightningProbe(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            probe.begin()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
                probe.end(trainer.global_step - 1)

    def fit(module, callbacks, accumulate, micro_batch, out):
        data = torch.utils.data.DataLoader(Tokens(micro_batch * accumulate * args.steps, seq, cfg["vocab_size"]),
                                           batch_size=micro_batch)
        trainer = L.Trainer(max_steps=args.steps, accelerator=args.accelerator, devices=1, precision="bf16-mixed",
                            accumulate_grad_batches=accumulate, callbacks=callbacks, logger=CSVLogger(out),
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            log_every_n_steps=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, data)
        return trainer

    out = args.out / "lightning"
    cb = MemprofCallback(warmup=2, every=1, budget=args.lightning_budget, target=args.target,
                         save_path=out / "memprof.json", print_report=False)
    trainer = fit(GPT2Module(), [cb, LightningProbe()], 1, batch, out)
    logged = _csv_metrics(Path(trainer.logger.log_dir) / "metrics.csv", "memprof/")
    advice = cb.advice
    first = {"steps": step_peaks_check(logged, probe.peaks), "advice": advice.to_dict(),
             "settings": advice.settings()}
    second = apply_best(advice, batch, lambda parts, micro: fit(
        GPT2Module(ckpt=parts["ckpt"], offload=parts["offload"]), [LightningProbe()], parts["accumulate"], micro,
        args.out / "lightning-applied"), probe)
    return {"workload": f"GPT-2 {cfg} in Lightning, bf16-mixed, {batch} x {seq}, AdamW",
            "budget": args.lightning_budget, "tracked_fit": first, "applied_fit": second}


# -- Hugging Face Trainer ----------------------------------------------------------------
def hf_fits(args) -> dict:
    from transformers import BertConfig, BertForMaskedLM, Trainer, TrainerCallback, TrainingArguments

    from memprof.callbacks import MemprofTrainerCallback

    cfg = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=512,
               vocab_size=1024, max_position_embeddings=128) if args.small else {}
    seq, batch = (128, 4) if args.small else (512, 32)
    probe = Probe()

    class HFProbe(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            probe.begin()

        def on_step_end(self, a, state, control, **kw):
            probe.end(state.global_step - 1)

    class MLM(torch.utils.data.Dataset):
        def __init__(self, n):
            self.tokens = Tokens(n, seq, cfg.get("vocab_size", 30522))

        def __len__(self):
            return len(self.tokens)

        def __getitem__(self, i):
            ids = self.tokens[i]
            return {"input_ids": ids, "labels": ids}

    def train(parts, micro, out, with_memprof):
        torch.manual_seed(0)
        model = BertForMaskedLM(BertConfig(**cfg))
        targs = TrainingArguments(output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=micro,
                                  gradient_accumulation_steps=parts["accumulate"], gradient_checkpointing=parts["ckpt"],
                                  gradient_checkpointing_kwargs={"use_reentrant": False} if parts["ckpt"] else None,
                                  bf16=True, logging_steps=1, report_to="none", save_strategy="no",
                                  disable_tqdm=True, use_cpu=args.accelerator == "cpu", dataloader_pin_memory=False)
        trainer = Trainer(model=model, args=targs, train_dataset=MLM(micro * parts["accumulate"] * args.steps),
                          callbacks=[HFProbe()])
        cb = None
        if with_memprof:
            cb = MemprofTrainerCallback(trainer, warmup=2, every=1, budget=args.hf_budget, target=args.target,
                                        print_report=False)
            trainer.add_callback(cb)
        trainer.train()
        return trainer, cb

    trainer, cb = train(plan_parts([]), batch, args.out / "hf", True)
    logged = [{"step": h["step"] - 1, **{k[len("memprof/"):]: v for k, v in h.items() if k.startswith("memprof/")}}
              for h in trainer.state.log_history if any(k.startswith("memprof/") for k in h)]
    advice = cb.advice
    first = {"steps": step_peaks_check(logged, probe.peaks), "advice": advice.to_dict(), "settings": advice.settings()}
    del trainer, cb  # HF's Trainer keeps its model and optimizer on the GPU after train()
    second = apply_best(advice, batch, lambda parts, micro: train(parts, micro, args.out / "hf-applied", False), probe)
    return {"workload": f"BERT-base MLM {cfg or 'bert-base-uncased config'} in HF Trainer, bf16, {batch} x {seq}, AdamW",
            "budget": args.hf_budget, "tracked_fit": first, "applied_fit": second}


# -- both ----------------------------------------------------------------------------------
class Probe:
    """The allocator's own peak of each optimizer step (the user's view of the counters)."""

    def __init__(self) -> None:
        self.peaks: dict[int, int] = {}
        self._on = torch.cuda.is_available()
        self._open = False  # a step's peak counters were reset and not yet read

    def begin(self) -> None:
        if self._on and not self._open:
            torch.cuda.reset_peak_memory_stats()
            self._open = True

    def end(self, step: int) -> None:
        if self._on:
            self.peaks[step] = torch.cuda.max_memory_allocated()
            self.reserved = torch.cuda.max_memory_reserved()
            self._open = False


def apply_best(advice, batch: int, run, probe: Probe) -> dict:
    plan = advice.best
    if plan is None:
        raise SystemExit(f"no plan fits {advice.budget} bytes:\n{advice.table}")
    row = advice.table.loc[plan]
    parts = plan_parts(advice.plans[plan]())
    probe.peaks.clear()
    base = 0
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()  # what the first fit left behind, if anything
    run(parts, batch // parts["accumulate"])
    out = {"plan": plan, "settings": advice.settings(plan), "predicted_peak_allocated": int(row["peak_allocated"]),
           "predicted_peak_reserved": int(row["peak_reserved"]), "budget_bytes": advice.budget}
    if torch.cuda.is_available():
        measured = max(v for k, v in probe.peaks.items() if k >= 1) - base  # steps with the optimizer's state
        reserved = torch.cuda.max_memory_reserved()
        out.update(allocated_before=base, measured_peak_allocated=measured, measured_peak_reserved=reserved,
                   error_allocated=int(row["peak_allocated"]) / measured - 1,
                   fits=reserved <= advice.budget)
    return out


def _csv_metrics(path: Path, prefix: str) -> list[dict]:
    import csv

    rows = []
    with open(path) as f:
        for r in csv.DictReader(f):
            m = {k[len(prefix):]: float(v) for k, v in r.items() if k.startswith(prefix) and v not in ("", None)}
            if m:
                rows.append({"step": int(r["step"]), **m})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["lightning", "hf"], help="one trainer (default: both)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--lightning-budget", default="16GiB")
    ap.add_argument("--hf-budget", default="8GiB")
    ap.add_argument("--target", default=None, help="GPU to simulate for the advice (default: this one)")
    ap.add_argument("--small", action="store_true", help="tiny models on the CPU: the plumbing only")
    args = ap.parse_args()
    args.accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if args.accelerator == "cpu" and args.target is None:
        args.target = "h200"
    logging.basicConfig(level=logging.WARNING)
    results = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
               "torch": torch.__version__, "command": " ".join(["python3", *sys.argv])}
    args.out.mkdir(parents=True, exist_ok=True)
    for which in [args.only] if args.only else ["lightning", "hf"]:
        results[which] = (lightning_fits if which == "lightning" else hf_fits)(args)
        (args.out / f"trainer-advice-{which}.json").write_text(json.dumps(
            {**{k: v for k, v in results.items() if k in ("gpu", "torch", "command")}, **results[which]},
            indent=1, default=str))
        print(json.dumps({k: v for k, v in results[which].items() if k != "tracked_fit"}, indent=1, default=str))
        for s in results[which]["tracked_fit"]["steps"]:
            print(f"{which} step {s['step']}: categories {s['categories_sum'] / GiB:.3f} GiB, allocator "
                  f"{s['allocator_peak'] / GiB:.3f} GiB ({s['error']:+.3%})")


if __name__ == "__main__":
    main()
