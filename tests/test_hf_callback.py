"""MemprofTrainerCallback on a real transformers.Trainer (CPU): exact bytes in the log history,
advice phrased as TrainingArguments, no hooks left behind, misconfiguration caught at setup."""

import importlib
import json
import logging
import subprocess
import sys
import warnings

import pytest
import torch
from torch.utils.data import Dataset

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import memprof  # noqa: E402
from memprof.callbacks import MemprofTrainerCallback  # noqa: E402

GiB = 1 << 30
# TrainingArguments' checkpointing flag: activation_checkpointing since transformers 5, gradient_checkpointing before.
CKPT = "activation_checkpointing" if hasattr(TrainingArguments, "activation_checkpointing") else "gradient_checkpointing"

# The advice tests' models. Their budgets sit well inside the window where the named
# plan is the fastest that fits on a simulated RTX 3060 (5 % margin on the simulation):
# - LOGITS: the fp32 logits (8 x 64 x 8192) dominate, which checkpointing cannot shrink.
#   accum2 needs 48.3 MiB; the next faster plan (offload_act) 75.6 MiB. Budget 60 MiB.
# - ATTENTION: eager attention's 8-head 256 x 256 probabilities (and their dropout)
#   dominate the blocks' activations; ckpt needs 86.1 MiB, the next faster plan
#   (bf16+offload_states) 128.8 MiB, while accum2 and offload_act, which fit, are slower.
#   Budget 100 MiB.
LOGITS = dict(n_layer=2, n_embd=16, n_head=2, vocab=8192, seq=64)
ATTENTION = dict(n_layer=2, n_embd=64, n_head=8, vocab=512, seq=256, attn="eager")


@pytest.fixture(autouse=True)
def _quiet():
    # transformers' config and deprecation warnings, accelerate's CPU notes
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    transformers.logging.set_verbosity(verbosity)


class FailingGPT2(GPT2LMHeadModel):
    """Raises in its third training forward (step 2, profiled), after its blocks ran."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        if self.training:
            self.training_forwards = getattr(self, "training_forwards", 0) + 1
            if self.training_forwards == 3:
                self.transformer(input_ids=input_ids)  # mid-step: module, saved-tensor and optimizer hooks in place
                raise RuntimeError("boom")
        return super().forward(input_ids=input_ids, labels=labels, **kwargs)


def gpt2(n_layer=2, n_embd=64, n_head=2, vocab=128, seq=16, attn="sdpa", cls=GPT2LMHeadModel):
    torch.manual_seed(0)
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab, n_positions=seq,
                        bos_token_id=0, eos_token_id=0, attn_implementation=attn)
    return cls(config)


class Tokens(Dataset):
    """Random token ids, the labels the ids themselves (causal LM)."""

    def __init__(self, n=64, seq=16, vocab=128, seed=0):
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_trainer(tmp_path, model=None, max_steps=6, data=None, eval_dataset=None, **args_kw):
    data = data or {}
    args_kw = {"save_strategy": "no", "per_device_train_batch_size": 8, **args_kw}
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=max_steps, logging_steps=1, report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0, **args_kw)
    return Trainer(model=model if model is not None else gpt2(), args=args, train_dataset=Tokens(**data),
                   eval_dataset=eval_dataset)


def train(trainer, **callback_kw):
    callback = MemprofTrainerCallback(trainer, print_report=False, **callback_kw)
    trainer.add_callback(callback)
    trainer.train()
    return callback


def memprof_logs(trainer):
    return [e for e in trainer.state.log_history if "memprof/peak_allocated_GiB" in e]


def module_hooks(model):
    return {n: (dict(m._forward_pre_hooks), dict(m._forward_hooks), dict(m._backward_hooks)) for n, m in model.named_modules()}


def assert_no_hooks(model, before):
    module = importlib.import_module("torch.nn.modules.module")
    optimizer = importlib.import_module("torch.optim.optimizer")  # not an attribute of torch.optim
    assert not module._global_forward_pre_hooks
    assert not module._global_forward_hooks
    assert not module._global_backward_hooks
    assert not optimizer._global_optimizer_pre_hooks
    assert not optimizer._global_optimizer_post_hooks
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert module_hooks(model) == before  # as before training: the model's own hooks only
    assert all(p._post_accumulate_grad_hooks is None or not p._post_accumulate_grad_hooks for p in model.parameters())
    # and the process-wide tracker slot is free again
    probe = torch.nn.Linear(2, 2)  # held: the tracker keeps only a weak reference to its model
    with memprof.track(probe):
        pass


def test_exact_metrics_in_log_history_for_the_profiled_steps(tmp_path):
    model = gpt2()
    before = module_hooks(model)
    trainer = make_trainer(tmp_path, model, max_steps=6)
    cb = train(trainer, warmup=2, every=2)
    r = cb.report
    # warmup=2: steps 0 and 1; every=2: 0, 2, 4. Report step k is global step k + 1.
    assert r.steps["step"].tolist() == [0, 1, 2, 3, 4, 5]
    assert r.meta["profiled_steps"] == [0, 1, 2, 4]
    logs = memprof_logs(trainer)
    assert [e["step"] for e in logs] == [1, 2, 3, 5]
    params = list(model.parameters())  # the tied embedding and head once
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    # AdamW (fused, the Trainer's default) keeps exp_avg and exp_avg_sq per parameter and a float32 step.
    state_bytes = 2 * param_bytes + 4 * len(params)
    assert r.optimizer_state == {"exp_avg": param_bytes, "exp_avg_sq": param_bytes, "step": 4 * len(params)}
    peaks = r.steps.set_index("step")["peak_allocated"]
    for step, e in zip([0, 1, 2, 4], logs):
        assert e["memprof/peak_allocated_GiB"] == peaks[step] / GiB
        assert e["memprof/parameters_GiB"] == param_bytes / GiB
        assert e["memprof/gradients_GiB"] == 0  # set to None by the zero_grad before the forward where it peaks
        assert "memprof/peak_reserved_GiB" not in e  # no allocator on the CPU
        assert isinstance(e["memprof/activations_GiB"], float) and e["memprof/activations_GiB"] > 0
    for e in logs[1:]:  # AdamW's state exists from the end of the first step
        assert e["memprof/optimizer_state_GiB"] == state_bytes / GiB
    # The reported step's breakdown is its logged one, category by category.
    (reported,) = [e for e in logs if e["step"] == r.peak.step + 1]
    assert {k: v for k, v in reported.items() if k.startswith("memprof/") and k != "memprof/peak_allocated_GiB"} == {
        f"memprof/{c}_GiB": n / GiB for c, n in r.peak.bytes.items()}
    # Logging them did not take the trainer's own loss log from any step.
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == [1, 2, 3, 4, 5, 6]
    saved = memprof.Report.load(tmp_path / "memprof.json")
    assert saved.peak == r.peak and saved.steps["step"].tolist() == [0, 1, 2, 3, 4, 5]
    assert cb.advice is None and not (tmp_path / "memprof-advice.json").exists()
    assert_no_hooks(model, before)


def test_a_tracker_open_already_keeps_the_run(tmp_path, caplog):
    """``memprof track train.py`` on a script that adds the callback (or a track() block around
    train()): the callback leaves the tracking to the tracker open already, saying so; it stopped
    the run before ("memprof.track is already active")."""
    trainer = make_trainer(tmp_path, max_steps=3)
    model = trainer.model
    with memprof.track(model, warmup=0) as outer, caplog.at_level(logging.WARNING, logger="memprof.callbacks"):
        callback = train(trainer, budget="24GiB")
    assert trainer.state.global_step == 3 and callback.report is None and callback.advice is None
    assert len(outer.report().steps) == 3 and not memprof_logs(trainer)
    assert "memprof is tracking this process already" in caplog.text


def test_evaluation_is_not_a_training_step(tmp_path):
    plain = train(make_trainer(tmp_path / "plain", max_steps=6), warmup=2, every=2).report
    model = gpt2()
    before = module_hooks(model)
    trainer = make_trainer(tmp_path / "eval", model, max_steps=6, eval_strategy="steps", eval_steps=2,
                           per_device_eval_batch_size=8, eval_dataset=Tokens(n=16, seed=1))
    cb = train(trainer, warmup=2, every=2)
    assert [e["step"] for e in trainer.state.log_history if "eval_loss" in e] == [2, 4, 6]
    r = cb.report
    # The evaluations after steps 2 and 4 (report steps 1 and 3) run inside report steps 2 and 4,
    # which are profiled: no row of their own, and under no_grad they keep nothing, so the
    # training forward and backward still peak where they did without evaluation. The one
    # after the last step is not tracked: no partial last row.
    assert r.steps["step"].tolist() == [0, 1, 2, 3, 4, 5]
    assert r.meta["profiled_steps"] == [0, 1, 2, 4]
    assert r.steps["peak_allocated"].dropna().tolist() == plain.steps["peak_allocated"].dropna().tolist()  # profiled
    assert r.peak.bytes == plain.peak.bytes
    assert [e["step"] for e in memprof_logs(trainer)] == [1, 2, 3, 5]
    assert_no_hooks(model, before)


def advise_run(tmp_path, shape, budget, max_steps=2, **callback_kw):
    shape = dict(shape)
    data = dict(seq=shape["seq"], vocab=shape["vocab"], n=16)
    trainer = make_trainer(tmp_path, gpt2(**shape), max_steps=max_steps, data=data)
    cb = train(trainer, warmup=1, every=0, budget=budget, target="rtx3060", **callback_kw) if budget else train(
        trainer, warmup=1, every=0)
    return trainer, cb


class LabelSmoothingTrainer(Trainer):
    """Hugging Face's documented custom loss: compute_loss takes the labels out of the inputs."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=0.1)
        return (loss, logits) if return_outputs else loss


def test_advice_on_a_compute_loss_that_pops_the_labels(tmp_path):
    """The advised step is simulated with what compute_loss was given (the model's forward, which
    the callback took its batch from before, never sees the labels: KeyError 'labels'), and each
    simulated call gets a dict of its own to pop from. The run itself is left as it was."""
    shape = dict(LOGITS)
    base = make_trainer(tmp_path, gpt2(**shape), max_steps=2, data=dict(seq=shape["seq"], vocab=shape["vocab"], n=16))
    trainer = LabelSmoothingTrainer(model=base.model, args=base.args, train_dataset=base.train_dataset)
    cb = train(trainer, warmup=1, every=0, budget="70MiB", target="rtx3060")
    assert cb.advice is not None and cb.advice.best == "accum2"
    assert "compute_loss" not in vars(trainer)
    assert [e["loss"] for e in trainer.state.log_history if "loss" in e][0] > 0


def test_advice_forces_accumulation_and_leaves_the_run_unchanged(tmp_path, capsys):
    trainer, cb = advise_run(tmp_path / "advised", LOGITS, "70MiB")
    advice = cb.advice
    assert advice.best == "accum2"
    assert advice.settings() == [
        "TrainingArguments(gradient_accumulation_steps=2, per_device_train_batch_size=4): "
        "the same 8 samples per optimizer step"
    ]
    assert advice.facts.micro_batches == 1 and advice.facts.batch_size == 8 and advice.facts.autocast is None
    out = capsys.readouterr().out
    assert "accum2:" in out and "gradient_accumulation_steps=2" in out  # printed (rich wraps the line)
    saved = json.loads((tmp_path / "advised" / "memprof-advice.json").read_text())
    assert saved["best"] == "accum2" and saved["door"] == "hf" and saved["settings"] == advice.settings()
    assert saved["target"] == "RTX3060-12GB" and saved["budget_bytes"] == 70 * (1 << 20)
    # The advice ran on a meta copy, between steps 1 and 2, with the tracker paused: the
    # run's weights, optimizer state and random state (GPT-2's dropout) are as without it.
    plain_trainer, plain = advise_run(tmp_path / "plain", LOGITS, None)
    assert plain.advice is None
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses == [e["loss"] for e in plain_trainer.state.log_history if "loss" in e] and len(losses) == 2
    for (name, p), q in zip(trainer.model.named_parameters(), plain_trainer.model.parameters()):
        assert torch.equal(p, q), name
    state, plain_state = trainer.optimizer.state_dict()["state"], plain_trainer.optimizer.state_dict()["state"]
    assert all(torch.equal(state[i][k], plain_state[i][k]) for i in state for k in state[i])
    assert cb.report.steps["step"].tolist() == plain.report.steps["step"].tolist() == [0, 1]
    # The advised run's model, still held here by its trainer, is another model to the plain run.
    held = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert plain.report.peak.bytes == {**cb.report.peak.bytes, "other_models": held}


def test_advice_forces_checkpointing(tmp_path):
    # One sample of 1024 tokens a step: no accumulation can split it, and the
    # attention scores of the eager kernel (8 x 1024^2 a layer) are what checkpointing saves.
    shape = dict(ATTENTION, seq=1024)
    trainer = make_trainer(tmp_path, gpt2(**shape), max_steps=1, data=dict(seq=shape["seq"], vocab=shape["vocab"], n=16),
                           per_device_train_batch_size=1)
    before = module_hooks(trainer.model)
    # The step as it is needs 272 MiB reserved (with the eager softmax's backward, grad * output,
    # 24 MiB a layer); checkpointing 182 MiB, bf16 with it 194 MiB (5 % margin: 195 MiB fits 185).
    cb = train(trainer, warmup=1, every=0, budget="195MiB", target="rtx3060")
    advice = cb.advice
    assert advice.best == "ckpt"
    assert advice.settings() == [
        f"TrainingArguments({CKPT}=True, {CKPT}_kwargs={{'use_reentrant': False}}) "
        "(a model without Hugging Face's support for it: `block.forward = functools.partial("
        "torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False)` for transformer.h.0, "
        "transformer.h.1 before training)"
    ]
    # Faster plans need more than the budget; offloading the activations fits but is slower,
    # and a batch of one sample cannot be split into micro-batches.
    table = advice.table
    assert not table.loc["baseline", "fits"] and not table.loc["bf16", "fits"] and table.loc["offload_act", "fits"]
    assert table.loc["ckpt", "seconds"] < table.loc["offload_act", "seconds"]
    assert not any(plan.startswith("accum") or "+accum" in plan for plan in table.index)
    assert cb.report.steps["step"].tolist() == [0]  # advised after the only step, then closed
    assert_no_hooks(trainer.model, before)


def test_a_checkpointing_run_is_the_baseline(tmp_path):
    # With checkpointing on, the run checkpoints every block already: those plans are left out.
    data = dict(seq=LOGITS["seq"], vocab=LOGITS["vocab"], n=16)
    trainer = make_trainer(tmp_path, gpt2(**LOGITS), max_steps=1, data=data, gradient_accumulation_steps=1,
                           **{CKPT: True})
    cb = train(trainer, warmup=1, every=0, budget="60MiB", target="rtx3060")
    assert cb.advice.facts.checkpointed == ["transformer.h.0", "transformer.h.1"]
    assert cb.advice.skipped["ckpt"] == "the fit already checkpoints the repeated blocks"
    assert "ckpt" not in cb.advice.table.index


def test_misconfiguration_fails_at_construction(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=1)
    with pytest.raises(ValueError, match=r"budget '12 parsecs' is neither a size \(e\.g\. 24GiB, 80GB\) nor a GPU"):
        MemprofTrainerCallback(trainer, budget="12 parsecs")
    with pytest.raises(ValueError, match=r"unknown GPU 'h1000'; valid names: .*H100"):
        MemprofTrainerCallback(trainer, budget="24GiB", target="h1000")
    with pytest.raises(ValueError, match=r"warmup must be an integer >= 0, got -1"):
        MemprofTrainerCallback(trainer, warmup=-1)
    with pytest.raises(ValueError, match=r"every must be an integer >= 0, got 1\.5"):
        MemprofTrainerCallback(trainer, every=1.5)
    with pytest.raises(ValueError, match=r'advise=True needs a budget or a target: MemprofTrainerCallback\(trainer, '
                                         r'budget="24GiB"\) or MemprofTrainerCallback\(trainer, advise=True, target="h100"\)'):
        MemprofTrainerCallback(trainer, advise=True)
    with pytest.raises(TypeError, match=r"needs the Trainer it logs through: .*"
                                        r"trainer\.add_callback\(MemprofTrainerCallback\(trainer\)\)"):
        MemprofTrainerCallback()
    with pytest.raises(TypeError, match=r"trainer must be a transformers\.Trainer, got TrainingArguments"):
        MemprofTrainerCallback(trainer.args)
    # Passing the class to Trainer(callbacks=[...]) makes HF build it without the trainer: the same message.
    with pytest.raises(TypeError, match="needs the Trainer it logs through"):
        Trainer(model=gpt2(), args=trainer.args, train_dataset=Tokens(), callbacks=[MemprofTrainerCallback])
    # A target alone is the budget: its usable memory.
    assert MemprofTrainerCallback(trainer, advise=True, target="rtx3060").budget == "rtx3060"


def test_callback_of_another_trainer_fails_at_train_begin(tmp_path):
    trainer = make_trainer(tmp_path / "a", max_steps=1)
    other = make_trainer(tmp_path / "b", max_steps=1)
    trainer.add_callback(MemprofTrainerCallback(other, print_report=False))
    with pytest.raises(RuntimeError, match=r"built for another Trainer than the one training"):
        trainer.train()


def test_hooks_removed_when_a_step_raises(tmp_path, caplog):
    model = gpt2(cls=FailingGPT2)
    before = module_hooks(model)
    trainer = make_trainer(tmp_path, model, max_steps=6)
    cb = MemprofTrainerCallback(trainer, print_report=False)
    trainer.add_callback(cb)
    with caplog.at_level(logging.WARNING, logger="memprof"), pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    # At once, with no further call: trainer.train is wrapped to close the tracker when it raises.
    assert_no_hooks(model, before)
    assert cb.report.steps["step"].tolist() == [0, 1]  # the failed step is not counted
    assert memprof.Report.load(tmp_path / "memprof.json").steps["step"].tolist() == [0, 1]
    assert "memprof: training raised RuntimeError; the report covers the 2 steps before it" in caplog.messages
    # The wrapper keeps the method's name and documentation, and the trainer trains again.
    assert trainer.train.__name__ == "train" and trainer.train.__doc__ == Trainer.train.__doc__
    trainer.train()  # the failing forward has passed; the same callback tracks the new run
    assert cb.report.steps["step"].tolist() == [0, 1, 2, 3, 4, 5]
    assert_no_hooks(model, before)


def test_retry_after_out_of_memory_closes_the_failed_attempt(tmp_path, caplog):
    # auto_find_batch_size catches an out-of-memory error inside train() and trains again with a smaller
    # batch: the next on_train_begin closes the tracker the failed attempt left open.
    class OutOfMemoryAt8(GPT2LMHeadModel):
        def forward(self, input_ids=None, labels=None, **kwargs):
            if self.training and len(input_ids) == 8:
                self.transformer(input_ids=input_ids)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
            return super().forward(input_ids=input_ids, labels=labels, **kwargs)

    model = gpt2(cls=OutOfMemoryAt8)
    before = module_hooks(model)
    trainer = make_trainer(tmp_path, model, max_steps=3, auto_find_batch_size=True)
    with caplog.at_level(logging.INFO, logger="memprof"):
        cb = train(trainer, warmup=3)
    assert trainer.state.train_batch_size == 7  # accelerate's find_executable_batch_size: 90 % of 8
    assert "memprof: closing the tracker of an interrupted training attempt; its steps are dropped" in caplog.messages
    assert cb.report.steps["step"].tolist() == [0, 1, 2]
    assert_no_hooks(model, before)


def test_resumed_run_logs_at_its_global_steps(tmp_path):
    first = make_trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    first.train()
    model = gpt2()
    before = module_hooks(model)
    trainer = make_trainer(tmp_path, model, max_steps=4)
    cb = MemprofTrainerCallback(trainer, warmup=1, every=1, print_report=False)
    trainer.add_callback(cb)
    trainer.train(resume_from_checkpoint=True)
    assert cb.report.steps["step"].tolist() == [0, 1]  # the steps of this run: global steps 3 and 4
    assert [e["step"] for e in memprof_logs(trainer)] == [3, 4]
    assert_no_hooks(model, before)


def test_only_rank_zero_logs_saves_and_advises(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Trainer, "is_world_process_zero", lambda self: False)
    trainer = make_trainer(tmp_path, max_steps=2)
    cb = MemprofTrainerCallback(trainer, warmup=1, budget="24GiB", print_report=True)
    trainer.add_callback(cb)
    trainer.train()
    assert cb.report.steps["step"].tolist() == [0, 1]  # every rank keeps its own report
    assert cb.advice is None
    assert not memprof_logs(trainer)
    assert not (tmp_path / "memprof.json").exists() and not (tmp_path / "memprof-advice.json").exists()
    assert "optimizer_state" not in capsys.readouterr().out


def test_sharded_run_gets_no_advice(tmp_path, monkeypatch, caplog):
    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.args.fsdp = ["full_shard"]  # as TrainingArguments(fsdp="full_shard") under torchrun would have it
    with caplog.at_level(logging.WARNING, logger="memprof"):
        cb = train(trainer, warmup=1, budget="24GiB")
    assert cb.advice is None
    (message,) = [m for m in caplog.messages if m.startswith("memprof: no advice")]
    assert "the model is sharded already (FSDP)" in message
    assert "measured so far: peak" in message and "in global step 1 (" in message


def test_print_report_or_log(tmp_path, capsys, caplog):
    trainer = make_trainer(tmp_path / "printed", max_steps=1)
    trainer.add_callback(MemprofTrainerCallback(trainer, print_report=True))
    capsys.readouterr()
    trainer.train()
    assert "memprof (track) on cpu: peak of step 0" in capsys.readouterr().out  # the report, with rich
    with caplog.at_level(logging.INFO, logger="memprof"):
        trainer = make_trainer(tmp_path / "logged", max_steps=1)
        train(trainer, log_metrics=False, save_report=False)
    assert "memprof (track)" not in capsys.readouterr().out
    assert any(m.startswith("memprof: peak") and "in global step 1 (" in m for m in caplog.messages)
    assert not memprof_logs(trainer)
    assert not (tmp_path / "logged" / "memprof.json").exists()


def test_import_does_not_import_transformers():
    code = ("import sys, memprof.callbacks as c; assert 'transformers' not in sys.modules; "
            "assert 'MemprofTrainerCallback' in dir(c)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_transformers_says_how_to_install(monkeypatch):
    import memprof.callbacks as callbacks

    monkeypatch.delattr(callbacks, "MemprofTrainerCallback", raising=False)
    monkeypatch.delitem(sys.modules, "memprof.callbacks.hf", raising=False)
    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r'pip install transformers.*pip install "memprof\[hf\]"'):
        from memprof.callbacks import MemprofTrainerCallback  # noqa: F401
