"""memprof: where training memory goes, and what to change so it fits."""

from .advisor import Advice, advise, max_batch_size, verify
from .categories import Category
from .devices import CATALOGUE, GPU, get_gpu
from .estimate import ModelStates, estimate_model_states
from .report import Breakdown, Report, compare
from .runner import ScriptError, observe_script
from .simulate import simulate
from .tracker import Tracker, track
from .trainer_advice import TrainerAdvice, advise_step

__all__ = [
    "Advice",
    "advise",
    "advise_step",
    "max_batch_size",
    "verify",
    "CATALOGUE",
    "GPU",
    "Breakdown",
    "Category",
    "ModelStates",
    "Report",
    "ScriptError",
    "Tracker",
    "TrainerAdvice",
    "compare",
    "estimate_model_states",
    "get_gpu",
    "observe_script",
    "simulate",
    "track",
]
__version__ = "0.1.0"
