"""What every memory strategy provides: apply itself, and say what a
single-process simulation of it cannot show."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from enum import Enum

from memprof.report import Report
from memprof.workload import Workload

__all__ = ["Door", "Prediction", "Strategy"]


class Door(str, Enum):
    """Where the user trains, which decides how a change is phrased."""

    SCRIPT = "script"  # their own loop: code to write
    LIGHTNING = "lightning"  # lightning.Trainer settings and LightningModule code
    HF = "hf"  # transformers.TrainingArguments

    @classmethod
    def of(cls, value: "str | Door") -> "Door":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"door {value!r} is not one of {[d.value for d in cls]}") from None


@dataclass(frozen=True)
class Prediction:
    """Predicted peak device memory and step time of a plan (per rank).

    ``device_seconds``: the part of ``seconds`` the device is busy (kernels,
    copies), where the simulation knows it. Well below ``seconds``, the host
    issuing the kernels sets the step's pace (a host-bound step), and the
    host's speed moves such a step's measured time by up to 2x between runs
    (benchmarks/results/step-time.md)."""

    peak_allocated: int
    peak_reserved: int
    seconds: float
    report: Report | None = None
    device_seconds: float | None = None

    @classmethod
    def from_report(cls, report: Report, time_factor: float = 1.0) -> "Prediction":
        """The last simulated step's peaks and (``time_factor`` times) its time."""
        last = report.steps.iloc[-1]
        return cls(int(last["peak_allocated"]), int(last["peak_reserved"]), float(last["seconds"]) * time_factor, report)

    def minus(self, nbytes: int, seconds: float = 0.0, busy: float = 0.0) -> "Prediction":
        """``nbytes`` fewer at the peaks; ``seconds`` more, of which the device is busy for ``busy``."""
        return replace(
            self,
            peak_allocated=max(self.peak_allocated - nbytes, 0),
            peak_reserved=max(self.peak_reserved - nbytes, 0),
            seconds=self.seconds + seconds,
            device_seconds=None if self.device_seconds is None else self.device_seconds + busy,
        )


class Strategy:
    """A change to a training step that trades memory for time."""

    #: Short name used in plan names, e.g. "bf16", "ckpt", "accum4".
    name: str = "strategy"
    #: Whether one rank's simulated step changes (False: only :meth:`adjust` accounts for it).
    simulated: bool = True
    #: Whether :meth:`memprof.workload.Workload.plan` can undo it (False: the
    #: workload is built again for it, e.g. weights converted in place).
    revertible: bool = True

    @property
    def key(self) -> str:
        """What tells this strategy's simulated step from another's: plans whose strategies have
        the same keys share one simulated step. Its name, and any setting the name leaves out."""
        return self.name

    def building(self) -> contextlib.AbstractContextManager:
        """What must hold from before the workload (or script) is built to the end of its run,
        such as the allocator's settings; by default nothing."""
        return contextlib.nullcontext()

    def apply(self, workload: Workload) -> None:
        """Change ``workload`` (and its model) in place, with PyTorch's own engines."""
        raise NotImplementedError

    def apply_simulated(self, workload: Workload) -> None:
        """Change a workload that runs on the simulated GPU; by default as for real."""
        self.apply(workload)

    def adjust(self, prediction: Prediction, baseline: Report, gpu) -> Prediction:
        """Account for what the single-process simulation does not run (sharding, host offload)."""
        return prediction

    def changes(self, coupling: dict[str, int]) -> str:
        """What this strategy changes in what training computes, for a step whose samples meet as
        ``coupling`` says (``Report.meta["sample_coupling"]``: :mod:`memprof.coupling`); "" for nothing."""
        return ""

    def code_change(self, facts=None, door: Door | str = Door.SCRIPT) -> str:
        """What to write in a training script, or set in Lightning's ``Trainer`` or
        Hugging Face's ``TrainingArguments`` (``door``), to do this; ``facts``
        (a ``memprof.script_advice.ScriptFacts``): what the training does already."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name
