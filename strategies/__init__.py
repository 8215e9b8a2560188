"""Memory-saving strategies, installed as ``memprof.strategies``.

Each strategy applies itself to a :class:`memprof.workload.Workload` with
PyTorch's own engines, and can run on memprof's simulated GPU; a plan is a
list of strategies. See :mod:`memprof.advisor` for choosing one.
"""

from .accumulation import Accumulation
from .allocator import ExpandableSegments
from .base import Prediction, Strategy
from .checkpointing import Checkpointing, find_blocks
from .mixed_precision import Autocast, PureBF16
from .offload import ActivationOffload
from .zero import StateOffload, ZeRO

__all__ = [
    "Accumulation",
    "ActivationOffload",
    "Autocast",
    "Checkpointing",
    "ExpandableSegments",
    "Prediction",
    "PureBF16",
    "StateOffload",
    "Strategy",
    "ZeRO",
    "find_blocks",
]
