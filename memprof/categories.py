"""The categories that every byte of training memory is attributed to."""

from __future__ import annotations

from enum import Enum

__all__ = ["Category", "ALLOCATED", "OUTSIDE_ALLOCATED"]


class Category(str, Enum):
    """Where a byte of device memory goes.

    The values are the public contract: they key ``Breakdown.bytes`` and name
    the columns of every table memprof produces.
    """

    PARAMETERS = "parameters"
    BUFFERS = "buffers"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"
    #: Gradients flowing backwards through the graph (dL/d activation): live only
    #: during backward, often a large share of the backward peak.
    ACTIVATION_GRADIENTS = "activation_gradients"
    INPUTS = "inputs"
    #: Parameters and buffers of modules outside the tracked model that the
    #: script keeps on the device: a frozen VAE or text encoder, a teacher, a
    #: reference model, an EMA copy; and copies of the model's parameters it
    #: keeps as tensors (an EMA's shadow parameters). Each is named by the variable
    #: that holds it (``Report.other_models``); it belongs to no module of the tracked model.
    OTHER_MODELS = "other_models"
    #: cuBLAS's workspaces: scratch memory PyTorch takes from its caching
    #: allocator for each cuBLAS handle and stream (one per thread that runs
    #: matrix products, e.g. autograd's backward thread) and keeps for the
    #: process's life; no tensor holds it.
    WORKSPACES = "workspaces"
    #: Allocated memory no other category claims: op workspaces, outputs that are
    #: not saved for backward, optimizer foreach temporaries, the loss.
    TEMPORARIES = "temporaries"
    #: Reserved by PyTorch's caching allocator but not allocated (CUDA only).
    FRAGMENTATION = "fragmentation"
    #: Device memory in use outside PyTorch's allocator: CUDA context, cuBLAS and
    #: NCCL workspaces, other libraries (NVML used - reserved; CUDA only).
    NON_PYTORCH = "non_pytorch"

    def __str__(self) -> str:
        return self.value


#: Categories that together make up ``torch.cuda.memory_allocated()``.
ALLOCATED: tuple[Category, ...] = (
    Category.PARAMETERS,
    Category.BUFFERS,
    Category.GRADIENTS,
    Category.OPTIMIZER_STATE,
    Category.ACTIVATIONS,
    Category.ACTIVATION_GRADIENTS,
    Category.INPUTS,
    Category.OTHER_MODELS,
    Category.WORKSPACES,
    Category.TEMPORARIES,
)

#: Categories of device memory beyond the allocated bytes.
OUTSIDE_ALLOCATED: tuple[Category, ...] = (Category.FRAGMENTATION, Category.NON_PYTORCH)
