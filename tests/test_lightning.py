"""MemprofCallback on a real Lightning Trainer (CPU): exact bytes, step counts, no hooks left behind."""

import csv
import importlib
import logging
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning")
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

import memprof  # noqa: E402
from memprof.callbacks import MemprofCallback  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
BATCHES_PER_EPOCH = 4


class Tiny(L.LightningModule):
    """Two 512x512 fp32 weights of exactly 1 MiB each, trained with AdamW."""

    def __init__(self, fail_at_step: int | None = None, error: BaseException | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(512, 512, bias=False), nn.ReLU(), nn.Linear(512, 512, bias=False))
        self.fail_at_step = fail_at_step
        self.error = error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net[1](self.net[0](x))
        if self.training and self.global_step == self.fail_at_step:
            # mid-forward: module, saved-tensor and optimizer hooks are all in place
            raise self.error if self.error is not None else RuntimeError("boom")
        return self.net[2](h)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


class TinyWithValidation(Tiny):
    def validation_step(self, batch, batch_idx):
        self(batch[0])


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(16 * BATCHES_PER_EPOCH, 512, generator=g)), batch_size=16)


def fit(callback, max_steps=3, model=None, val=False, **trainer_kw):
    trainer_kw = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": max_steps,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "callbacks": [callback],
        **trainer_kw,
    }
    trainer = L.Trainer(**trainer_kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "does not have many workers" and friends
        trainer.fit(model or Tiny(), loader(), loader() if val else None)
    return trainer


def assert_no_hooks(model=None):
    module = importlib.import_module("torch.nn.modules.module")
    optimizer = importlib.import_module("torch.optim.optimizer")  # not an attribute of torch.optim
    assert not module._global_forward_pre_hooks
    assert not module._global_forward_hooks
    assert not optimizer._global_optimizer_pre_hooks
    assert not optimizer._global_optimizer_post_hooks
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    if model is not None:
        assert not model._forward_pre_hooks
        assert all(p._post_accumulate_grad_hooks is None or not p._post_accumulate_grad_hooks for p in model.parameters())
    # and the process-wide tracker slot is free again
    probe = nn.Linear(2, 2)  # held: the tracker keeps only a weak reference to its model
    with memprof.track(probe):
        pass


def test_exact_bytes_and_one_row_per_optimizer_step():
    cb = MemprofCallback(warmup=2, every=3, print_report=False)
    model = Tiny()
    # 5 steps cross the epoch boundary (4 batches an epoch); no validation.
    trainer = fit(cb, max_steps=5, model=model)
    r = cb.report
    assert trainer.global_step == 5
    assert len(r.steps) == 5
    assert r.steps["step"].tolist() == [0, 1, 2, 3, 4]
    assert r.steps["profiled"].tolist() == [True, True, False, True, False]
    assert r.meta["profiled_steps"] == [0, 1, 3]
    assert r.peak.bytes["parameters"] == 2 * MiB
    assert r.peak.bytes["gradients"] == 2 * MiB
    assert r.optimizer_state["exp_avg"] == 2 * MiB
    assert r.optimizer_state["exp_avg_sq"] == 2 * MiB
    assert r.optimizer_state["step"] == 8  # AdamW's fp32 step counter per parameter, on the CPU here
    m = r.modules
    assert m.loc["Tiny.net.0", ["parameters", "gradients", "optimizer_state"]].tolist() == [MiB, MiB, 2 * MiB + 4]
    assert m.loc["Tiny.net.2", ["parameters", "gradients", "optimizer_state"]].tolist() == [MiB, MiB, 2 * MiB + 4]
    assert_no_hooks(model)


def test_a_tracker_open_already_keeps_the_fit(recwarn):
    """``memprof track train.py`` on a script whose Trainer has the callback (or a track() block
    around fit): the callback leaves the tracking to the tracker open already, saying so; it stopped
    the fit before ("memprof.track is already active")."""
    cb = MemprofCallback(print_report=False)
    model = Tiny()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    with memprof.track(model, warmup=0) as outer:
        trainer.fit(model, loader())
    assert trainer.global_step == 3 and cb.report is None
    assert len(outer.report().steps) == 3 and outer.report().peak.bytes["parameters"] == 2 * MiB
    messages = [str(w.message) for w in recwarn]
    assert any("memprof is tracking this process already" in m for m in messages)
    assert not any("ran no training step" in m for m in messages)
    assert_no_hooks(model)


def test_gradient_accumulation_counts_optimizer_steps():
    cb = MemprofCallback(print_report=False)
    trainer = fit(cb, max_steps=2, accumulate_grad_batches=2)
    assert trainer.global_step == 2
    assert len(cb.report.steps) == 2  # 4 batches, 2 optimizer steps
    assert_no_hooks()


def test_validation_after_the_last_step_adds_one_partial_row():
    # The epoch (4 batches) ends exactly at max_steps, so validation runs after
    # the last optimizer step; its forward opens a step that no optimizer step
    # ends, and the tracker keeps it as a last row. The sanity check runs before
    # on_train_start, so it is not tracked.
    cb = MemprofCallback(print_report=False)
    trainer = fit(cb, max_steps=BATCHES_PER_EPOCH, model=TinyWithValidation(), val=True, limit_val_batches=1)
    assert trainer.global_step == BATCHES_PER_EPOCH
    assert cb.report.steps["step"].tolist() == list(range(BATCHES_PER_EPOCH + 1))
    assert cb.report.meta["profiled_steps"] == [0, 1, 2]
    assert_no_hooks()


def test_hooks_removed_when_training_raises(tmp_path):
    path = tmp_path / "report.json"
    cb = MemprofCallback(save_path=path, print_report=False)
    model = Tiny(fail_at_step=2)  # a warmup step: profiled, all hooks installed
    with pytest.raises(RuntimeError, match="boom"):
        fit(cb, max_steps=5, model=model)
    assert_no_hooks(model)
    # The steps before the error are kept and saved (what you want after an OOM).
    assert cb.report.steps["step"].tolist() == [0, 1]
    assert memprof.Report.load(path).steps["step"].tolist() == [0, 1]


def test_out_of_memory_in_a_fit_is_explained(tmp_path, caplog):
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
    cb = MemprofCallback(print_report=False)
    model = Tiny(fail_at_step=2, error=error)
    with caplog.at_level(logging.ERROR, logger="memprof"), pytest.raises(torch.OutOfMemoryError) as info:
        fit(cb, max_steps=5, model=model, default_root_dir=tmp_path)
    assert info.value is error  # the caller gets the very error
    assert_no_hooks(model)
    (json_path,) = tmp_path.glob("memprof-oom-*.json")
    r = memprof.Report.load(json_path)
    assert r.peak.step == 2 and r.peak.phase == "forward Tiny"
    # the two 1 MiB weights, AdamW's two states of each and its two float32 step counts
    assert r.peak.bytes["parameters"] == 2 * MiB and r.peak.bytes["optimizer_state"] == 4 * MiB + 2 * 4
    assert r.peak.bytes["inputs"] == 16 * 512 * 4  # the batch (which the first Linear saved)
    assert r.peak.bytes["activations"] == 16 * 512 * 4  # the ReLU's output
    assert r.modules.loc["Tiny.net.0", "parameters"] == MiB
    (message,) = [m for m in caplog.messages if m.startswith("out of memory")]
    assert "in step 2 (forward Tiny)" in message and json_path.name in message
    assert "The largest category was optimizer_state (4.00 MiB, 50 %), most of it in Tiny.net (4.00 MiB)." in message


def test_saved_report_loads(tmp_path):
    path = tmp_path / "out" / "memprof.json"
    cb = MemprofCallback(save_path=str(path), print_report=False)
    fit(cb, max_steps=3)
    loaded = memprof.Report.load(path)
    assert loaded.peak == cb.report.peak
    assert loaded.optimizer_state == cb.report.optimizer_state
    assert loaded.steps["step"].tolist() == [0, 1, 2]
    assert [p.name for p in path.parent.iterdir()] == ["memprof.json"]  # no temporary left


def test_metrics_in_csv_logger(tmp_path):
    logger = CSVLogger(tmp_path, name="logs")
    cb = MemprofCallback(warmup=2, every=3, print_report=False)
    fit(cb, max_steps=5, logger=logger)
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("memprof/peak_allocated_GiB")]
    assert [int(r["step"]) for r in rows] == [0, 1, 3]  # the profiled steps
    last = rows[-1]
    assert float(last["memprof/parameters_GiB"]) == 2 * MiB / GiB
    assert float(last["memprof/gradients_GiB"]) == 2 * MiB / GiB
    assert float(last["memprof/optimizer_state_GiB"]) == (4 * MiB + 8) / GiB
    assert float(last["memprof/activations_GiB"]) > 0
    assert float(last["memprof/peak_allocated_GiB"]) == cb.report.peak.allocated / GiB


def test_no_logging_when_disabled(tmp_path):
    logger = CSVLogger(tmp_path, name="logs")
    fit(MemprofCallback(log_metrics=False, print_report=False), max_steps=2, logger=logger)
    metrics = tmp_path / "logs" / "version_0" / "metrics.csv"
    assert not metrics.exists() or "memprof/" not in metrics.read_text()  # the CSV is written only if anything was logged


def test_print_report_or_log(capsys, caplog):
    fit(MemprofCallback(print_report=True), max_steps=1)
    assert "optimizer_state" in capsys.readouterr().out
    with caplog.at_level(logging.INFO, logger="memprof"):
        fit(MemprofCallback(print_report=False), max_steps=1)
    assert "optimizer_state" not in capsys.readouterr().out
    assert any("memprof: peak" in r.getMessage() for r in caplog.records)


@pytest.mark.filterwarnings("ignore:.*LeafSpec")  # from Lightning's _pytree on the second fit
def test_fit_twice():
    cb = MemprofCallback(print_report=False)
    trainer = fit(cb, max_steps=2)
    first = cb.report
    assert len(first.steps) == 2
    # The same trainer has reached max_steps: nothing trains, the report stays.
    with pytest.warns(UserWarning, match="ran no training step"):
        trainer.fit(trainer.lightning_module, loader())
    assert cb.report is first
    assert_no_hooks()
    # A new trainer trains again with the same callback: a new report.
    fit(cb, max_steps=3)
    assert cb.report is not first and len(cb.report.steps) == 3
    assert_no_hooks()


def test_only_rank_zero_saves_and_logs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(L.Trainer, "is_global_zero", property(lambda self: False))
    path = tmp_path / "r.json"
    logger = CSVLogger(tmp_path, name="logs")
    cb = MemprofCallback(save_path=path, print_report=True)
    fit(cb, max_steps=2, logger=logger)
    assert len(cb.report.steps) == 2  # every rank keeps its own report
    assert not path.exists()
    assert "optimizer_state" not in capsys.readouterr().out
    metrics = tmp_path / "logs" / "version_0" / "metrics.csv"
    if metrics.exists():
        assert "memprof/" not in metrics.read_text()


def test_arguments_checked():
    with pytest.raises(ValueError, match="every"):
        MemprofCallback(every=-1)
    with pytest.raises(ValueError, match="warmup"):
        MemprofCallback(warmup=1.5)


def test_import_does_not_import_lightning():
    code = "import sys, memprof.callbacks as c; assert 'lightning' not in sys.modules; assert 'MemprofCallback' in dir(c)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_lightning_says_how_to_install(monkeypatch):
    import memprof.callbacks as callbacks

    monkeypatch.delattr(callbacks, "MemprofCallback", raising=False)
    monkeypatch.delitem(sys.modules, "memprof.callbacks.lightning", raising=False)
    for name in [m for m in sys.modules if m == "lightning" or m.startswith("lightning.")]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r'pip install lightning.*pip install "memprof\[lightning\]"'):
        from memprof.callbacks import MemprofCallback  # noqa: F401
    with pytest.raises(AttributeError):
        callbacks.NoSuchThing


# -- advice --------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)  # the simulation must leave the fit's random masks alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.relu(self.fc1(x))))


class Blocks(L.LightningModule):
    """Four repeated blocks on 8192 x 128 inputs: activations outweigh the 0.5 M parameters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(128, 128), nn.Linear(128, 10)
        self.blocks = nn.ModuleList([Block(128) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)

    def training_step(self, batch, batch_idx):
        loss = nn.functional.cross_entropy(self(batch[0]), batch[1])
        self.log("train_loss", loss)  # what the copy logs must not reach the fit's results
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit_blocks(callback, max_steps=3, **trainer_kw):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8192 * 3, 128, generator=g), torch.randint(0, 10, (8192 * 3,), generator=g))
    model = Blocks()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], **trainer_kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(data, batch_size=8192 // trainer.accumulate_grad_batches))
    return trainer, model


def test_advice_in_lightning_terms_for_a_budget_that_forces_checkpointing(tmp_path, capsys):
    # bf16-mixed already: the baseline runs under bf16 autocast (136 MiB reserved on the simulated
    # RTX 3060, its bias gradients' sums over 8192 rows staged across thread blocks); checkpointing
    # the four blocks brings it to 114 MiB, under 122 MiB less the 5 % margin.
    cb = MemprofCallback(budget="122MiB", target="rtx3060", warmup=2, print_report=False)
    trainer, model = fit_blocks(cb, precision="bf16-mixed", logger=False)
    advice = cb.advice
    assert advice.best == "ckpt"
    assert advice.facts.autocast == "bf16" and advice.facts.micro_batches == 1
    assert not advice.table.loc["baseline", "fits"]
    assert all("bf16" not in plan for plan in advice.table.index)  # done already: left out, and said so
    assert advice.skipped["bf16+ckpt"] == "the fit already runs its forward under bf16 autocast"
    assert advice.settings() == [
        "in the LightningModule's configure_model, checkpoint each repeated block: `block.forward = "
        "functools.partial(torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False)` for blocks.0, "
        "blocks.1, blocks.2, ... (with FSDPStrategy: FSDPStrategy(activation_checkpointing_policy={Block}))"
    ]
    out = capsys.readouterr().out
    assert "ckpt:" in out and "left out bf16," in out
    assert advice.measured.peak.bytes["parameters"] == sum(p.numel() * 4 for p in model.parameters())
    assert_no_hooks(model)


def test_advice_for_a_budget_that_forces_accumulation_leaves_the_fit_alone():
    # 104 MiB less the margin: checkpointing alone (114 MiB reserved) does not fit, two micro-batches
    # (96 MiB) do. Checkpointing allocates less than the budget, though, and is faster: with
    # expandable segments it fits too, and is advised with them.
    cb = MemprofCallback(budget="104MiB", target="rtx3060", warmup=1, print_report=False)
    trainer, model = fit_blocks(cb, precision="bf16-mixed", logger=False)
    t = cb.advice.table
    assert t.index[:2].tolist() == ["ckpt+expandable", "accum2"] and t["fits"].iloc[:2].all()
    assert not t.loc["ckpt", "fits"] and t.loc["ckpt", "peak_allocated"] * 1.05 <= 104 * 2**20
    assert t.loc["ckpt+expandable", "seconds"] == t.loc["ckpt", "seconds"] < t.loc["accum2", "seconds"]
    assert cb.advice.settings("accum2") == [
        "Trainer(accumulate_grad_batches=2) and DataLoader(batch_size=4096): the same 8192 samples per optimizer step"
    ]
    assert cb.advice.settings()[-1].startswith("start training with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    # The advice ran on a meta copy: the fit trained exactly as without it.
    plain = MemprofCallback(warmup=1, print_report=False)
    _, same = fit_blocks(plain, precision="bf16-mixed", logger=False)
    for a, b in zip(model.parameters(), same.parameters()):
        assert torch.equal(a, b)
    assert len(cb.report.steps) == len(plain.report.steps) == 3
    assert cb.report.steps["profiled"].tolist() == plain.report.steps["profiled"].tolist()
    assert_no_hooks(model)


def test_advice_starts_from_the_fits_accumulation_and_precision():
    cb = MemprofCallback(budget="rtx3060", warmup=1, print_report=False)
    trainer, _ = fit_blocks(cb, max_steps=2, accumulate_grad_batches=2, logger=False)
    advice = cb.advice
    assert advice.gpu.name == "RTX3060-12GB"
    assert advice.facts.micro_batches == 2 and advice.facts.autocast is None
    assert advice.facts.batch_size == 4096
    # 12 GB is plenty: every plan fits, and the fastest predicted is recommended.
    assert advice.table["fits"].all() and advice.best == advice.table["seconds"].idxmin()
    assert advice.settings("bf16") == ["Trainer(precision='bf16-mixed')"]
    assert advice.settings("accum2") == [
        "Trainer(accumulate_grad_batches=4) and DataLoader(batch_size=2048): the same 8192 samples per optimizer step"
    ]


def test_advice_asked_wrongly_fails_at_construction():
    with pytest.raises(ValueError, match=r'advise=True needs a budget or a target: MemprofCallback\(budget="24GiB"\)'):
        MemprofCallback(advise=True)
    with pytest.raises(ValueError, match="budget '12 potatoes'"):
        MemprofCallback(budget="12 potatoes")
    with pytest.raises(ValueError, match="no-such-gpu"):
        MemprofCallback(budget="24GiB", target="no-such-gpu")
    assert MemprofCallback().advise is False and MemprofCallback(budget="24GiB").advise is True


def test_advice_in_a_fit_shorter_than_the_warmup_and_only_on_rank_zero(monkeypatch, capsys):
    # fast_dev_run: one step, fewer than the warm-up's three: the advice comes after it.
    cb = MemprofCallback(budget="rtx3060", print_report=False)
    trainer, model = fit_blocks(cb, max_steps=-1, fast_dev_run=True)
    assert trainer.global_step == 1 and cb.advice is not None and cb.advice.table.loc["baseline", "fits"]
    assert "plans for" in capsys.readouterr().out
    assert_no_hooks(model)
    monkeypatch.setattr(L.Trainer, "is_global_zero", property(lambda self: False))
    cb = MemprofCallback(budget="rtx3060", warmup=1, print_report=False)
    trainer, model = fit_blocks(cb, max_steps=2, logger=False)
    assert cb.advice is None and "plans for" not in capsys.readouterr().out
    assert len(cb.report.steps) == 2
    assert_no_hooks(model)


def test_no_advice_for_manual_optimization(recwarn):
    class Manual(Blocks):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = nn.functional.cross_entropy(self(batch[0]), batch[1])
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    cb = MemprofCallback(budget="rtx3060", warmup=1, print_report=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g))
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    trainer.fit(Manual(), DataLoader(data, batch_size=32))
    assert cb.advice is None
    assert any("no advice for a fit with manual optimization" in str(w.message) for w in recwarn)


# -- on a real GPU ---------------------------------------------------------------------
from conftest import cuda  # noqa: E402


class Wide(L.LightningModule):
    """8 Linear(8192, 8192) layers on a batch expanded to 2^21 rows: each layer's output is
    64 GiB in fp32, so the second one does not fit beside the first on a 140 GiB GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(8)])

    def training_step(self, batch, batch_idx):
        return self.net(batch[0].expand(2**21, -1)).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


@cuda
@pytest.mark.cuda
def test_a_fit_that_runs_out_of_the_gpus_memory_is_explained(tmp_path, caplog):
    data = DataLoader(TensorDataset(torch.randn(4, 8192)), batch_size=1)
    cb = MemprofCallback(print_report=False)
    model = Wide()
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                        default_root_dir=tmp_path)
    with caplog.at_level(logging.ERROR, logger="memprof"), pytest.raises(torch.OutOfMemoryError) as info:
        trainer.fit(model, data)
    assert type(info.value) is torch.OutOfMemoryError and str(info.value).startswith("CUDA out of memory.")
    assert_no_hooks(model)
    (json_path,) = tmp_path.glob("memprof-oom-*.json")
    r = memprof.Report.load(json_path)
    assert r.peak.step == 0 and r.peak.phase.startswith("forward Wide.net")
    assert r.peak.bytes["parameters"] == 8 * (8192 * 8192 + 8192) * 4
    assert r.peak.allocated == r.meta["out_of_memory"]["allocated"]
    largest = max(("activations", "inputs", "parameters"), key=lambda c: r.peak.bytes[c])
    assert largest == "activations"
    (message,) = [m for m in caplog.messages if m.startswith("out of memory")]
    assert json_path.name in message and "The largest category was activations" in message
    del model, trainer, info
    torch.cuda.empty_cache()
