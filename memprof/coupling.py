"""What makes one sample's gradient depend on the other samples of its batch.

Gradient accumulation over K micro-batches gives the whole batch's gradient
only where the loss is a sum (or a mean) of per-sample terms. Common kinds
of training are not, and K micro-batches then train something else:

* batch normalization in training mode normalizes each sample with the mean
  and variance of the samples beside it (Ioffe & Szegedy, 2015): each
  micro-batch with statistics of 1/K of them, the running statistics updated
  K times a step;
* products over pairs of samples: an in-batch contrastive loss's (N, N)
  similarities (CLIP; SimCLR's NT-Xent over its two views joined, 2N), a
  triplet loss's pairwise distances: each sample meets only the others of its
  micro-batch, 1/K as many negatives;
* other statistics of the batch: a mean over the samples fed back to each
  (``z - z.mean(0)``), a variance or a norm over them (Barlow Twins' and
  VICReg's standardization and variance terms). A mean over the samples that
  is not fed back (a loss's) is the micro-batches' sum, divided by K.

They show in the autograd graph behind the loss, on any device and without
running anything (nothing saved is unpacked, so no checkpoint recomputes and
no offloaded tensor comes back): a batch norm's backward node that saved
``training=True``; a matrix product (``mm``, ``addmm``, a one-matrix ``bmm``
as ``einsum`` makes, ``cdist``) of two tensors that carry gradients and are no
parameters, into an (n, n) matrix, or an elementwise operator broadcasting an
(n, 1, ...) tensor against a (1, n, ...) one, where n is 1-4 times the
leading size of the batch; a variance, standard deviation or norm over the
first dimension of such a tensor, or a mean or sum over it that an
elementwise operator combines with a tensor of n rows. A parameter, its cast
or its transpose is no sample: a linear layer with as many outputs as the
batch has rows couples nothing. Not found: samples mixed otherwise
(StyleGAN's minibatch standard deviation over groups of the batch, a sort
over the batch), and products with an operand that carries no gradient (a
frozen encoder's features: its graph does not say what it is).
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Iterable

import torch

__all__ = ["Coupling", "sample_coupling", "what_changes"]


class Coupling(str, Enum):
    """A way the samples of a batch meet in training."""

    BATCH_NORM = "batch_norm"
    PAIRS = "pairs"
    BATCH_STATISTICS = "batch_statistics"


#: Nodes that pass a tensor on as it is, but for its view, dtype or layout: a parameter behind
#: them (autocast's cast, a linear layer's transpose) is still that parameter.
_PASSING = frozenset({"TBackward0", "TransposeBackward0", "TransposeBackward1", "PermuteBackward0", "ViewBackward0",
                      "UnsafeViewBackward0", "ReshapeAliasBackward0", "ToCopyBackward0", "ExpandBackward0",
                      "CloneBackward0", "AliasBackward0", "UnsqueezeBackward0", "SqueezeBackward0",
                      "SqueezeBackward1", "SqueezeBackward2"})
#: Reductions that are sums over what they reduce: over the samples, a statistic of the batch only where
#: its result is fed back to each sample (a loss's mean over the samples is K micro-batches' sum).
_SUMS = frozenset({"MeanBackward0", "MeanBackward1", "SumBackward0", "SumBackward1"})
#: Reductions that are not: over the samples, each micro-batch's is another (a variance, a norm).
_SPREADS = frozenset({"VarBackward0", "StdBackward0", "VarMeanBackward0", "StdMeanBackward0",
                      "LinalgVectorNormBackward0"})
#: Products whose last two output dimensions are the rows of their two operands.
_PRODUCTS = {"MmBackward0": (0, 1), "AddmmBackward0": (1, 2), "BmmBackward0": (0, 1), "CdistBackward0": (0, 1),
             "EuclideanDistBackward0": (0, 1)}


def sample_coupling(roots: Any, samples: Iterable[int]) -> dict[str, int]:
    """The couplings the autograd graph behind ``roots`` (a tensor or tensors, as backward
    is given them) has, for a batch whose tensors lead with the sizes ``samples``:
    ``{Coupling value: how many of its nodes}``, empty where none."""
    sizes = {m * n for n in samples if isinstance(n, int) and n > 1 for m in (1, 2, 3, 4)}
    todo = [t.grad_fn for t in ([roots] if isinstance(roots, torch.Tensor) else roots or ())
            if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen, found, expanded = set(todo), {}, set()
    while todo:
        node = todo.pop()
        kind = _kind(node, sizes, expanded)
        if kind is not None:
            found[kind.value] = found.get(kind.value, 0) + 1
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    # Both halves of an outer product expanded before they meet (cosine_similarity expands its operands
    # to one shape first): (n, 1, ...) and (1, n, ...) made (n, n, ...) in the same graph.
    pairs = sum(1 for out, i, j in expanded if i < j and (out, j, i) in expanded)
    if pairs:
        found[Coupling.PAIRS.value] = found.get(Coupling.PAIRS.value, 0) + pairs
    return found


def _kind(node: Any, sizes: set[int], expanded: set) -> Coupling | None:
    """The coupling ``node`` makes; an expansion of a non-parameter from (.., n at i, 1 at j ..) to
    n at both is added to ``expanded`` as ``(shape, i, j)``."""
    name = type(node).__name__
    if "BatchNorm" in name and "NoUpdate" not in name:
        # native_batch_norm's, cuDNN's and SyncBatchNorm's backward alike; in eval mode the node saved False
        return Coupling.BATCH_NORM if getattr(node, "_saved_training", True) is True else None
    if not sizes:
        return None
    if name in _SPREADS:
        return Coupling.BATCH_STATISTICS if _over_samples(node, sizes) else None
    out = _shape(node, 0)
    if out is None or len(out) < 2 or not sizes.intersection(out):
        return None
    operands = [f for f, _ in node.next_functions]
    if name == "ExpandBackward0" and operands and operands[0] is not None and not _parameter(operands[0]):
        before = _shape(operands[0], node.next_functions[0][1])
        if before is not None:
            before = [1] * (len(out) - len(before)) + before
            expanded.update((tuple(out), i, j) for i, j in _dim_pairs(len(out))
                            if out[i] == out[j] == before[i] in sizes and before[j] == 1)
        return None
    if name in _PRODUCTS:
        if out[-1] != out[-2] or out[-1] not in sizes or len(out) > 3 or len(out) == 3 and out[0] != 1:
            return None  # not square over the samples, or a batch of matrices (attention's scores per head)
        i, j = _PRODUCTS[name]
        pair = operands[i:j + 1] if len(operands) > j else []
        if len(pair) != 2 or any(f is None or _parameter(f) for f in pair):
            return None
        # Two square matrices of the batch's size multiplied are matrices, not samples (a flow's 1x1
        # convolution's weight made of its LU factors, as many channels as the batch's samples)
        first = _shape(pair[0], node.next_functions[i][1])
        return None if first is None or first[-1] == out[-1] else Coupling.PAIRS
    if len(operands) == 2 and all(f is not None for f in operands):
        a, b = (_shape(f, nr) for f, nr in node.next_functions)
        if a is not None and b is not None and _outer(out, a, b, sizes):
            return Coupling.PAIRS if not any(_parameter(f) for f in operands) else None
        if a is not None and b is not None and out[0] in sizes and any(
                len(x) == len(out) and x[0] == out[0] and (len(y) < len(out) or y[0] == 1) and _sum_over_samples(f, sizes)
                for x, (y, f) in ((a, (b, operands[1])), (b, (a, operands[0])))):
            return Coupling.BATCH_STATISTICS  # a mean over the samples fed back to each: x - x.mean(0)
    return None


def _sum_over_samples(node: Any, sizes: set[int]) -> bool:
    """Whether ``node`` is, through views and casts, a mean or sum over the samples (:func:`_over_samples`)."""
    node = _source(node)
    return node is not None and type(node).__name__ in _SUMS and _over_samples(node, sizes)


def _over_samples(reduction: Any, sizes: set[int]) -> bool:
    """Whether ``reduction`` reduces the first dimension of a tensor that leads with samples and is
    no parameter (a weight's norm over its rows, as weight normalization takes it, is no statistic
    of the batch)."""
    if not reduction.next_functions or reduction.next_functions[0][0] is None:
        return False
    operand, nr = reduction.next_functions[0]
    shape = _shape(operand, nr)
    if not shape or shape[0] not in sizes or _parameter(operand):
        return False
    dims = getattr(reduction, "_saved_dim", None)  # none saved: every dimension (x.mean(), x.std())
    dims = (dims,) if isinstance(dims, int) else dims
    # Saved as unsigned 64-bit integers where negative (dim=-1 reads 2**64 - 1)
    return not dims or any((d - (1 << 64) if d >= 1 << 63 else d) % len(shape) == 0 for d in dims)


def _shape(node: Any, nr: int) -> list[int] | None:
    """The shape of output ``nr`` of the operator behind ``node`` (its gradient's shape)."""
    try:
        return list(node._input_metadata[nr].shape)
    except (AttributeError, IndexError, RuntimeError, TypeError):  # a nested tensor's, an older torch
        return None


def _outer(out: list[int], a: list[int], b: list[int], sizes: set[int]) -> bool:
    """Whether ``a`` and ``b`` broadcast into ``out`` as an outer product over two of its
    dimensions of a size in ``sizes``: (n, 1, ...) against (1, n, ...)."""
    r = len(out)
    a, b = [1] * (r - len(a)) + a, [1] * (r - len(b)) + b
    return any(out[i] == out[j] in sizes and a[i] == out[i] and a[j] == 1 and b[i] == 1 and b[j] == out[j]
               for i, j in _dim_pairs(r))


def _dim_pairs(rank: int) -> list[tuple[int, int]]:
    """Two dimensions, one of them the first: a batch's samples lead its activations (an additive
    attention's queries against its keys, (N, T, 1, D) + (N, 1, T, D), pair tokens, not samples)."""
    return [(i, j) for i in range(rank) for j in range(rank) if i != j and 0 in (i, j)]


def _parameter(node: Any) -> bool:
    """Whether ``node`` leads to a leaf tensor (a parameter) through views and casts alone."""
    return type(_source(node)).__name__ == "AccumulateGrad"


def _source(node: Any) -> Any:
    """The first node behind ``node`` that is no view or cast of one tensor (:data:`_PASSING`), or None."""
    for _ in range(16):
        if type(node).__name__ not in _PASSING:
            return node
        nxt = [f for f, _ in node.next_functions if f is not None]
        if len(nxt) != 1:
            return None
        node = nxt[0]
    return None


def what_changes(found: dict[str, int], k: int | str) -> str:
    """What ``k`` micro-batches change in a training whose graph has the couplings
    ``found`` (:func:`sample_coupling`), in words; "" where nothing."""
    parts = []
    n = found.get(Coupling.BATCH_NORM.value, 0)
    if n:
        parts.append(f"batch norm ({n} in training mode) normalizes each micro-batch with its own statistics, "
                     f"of 1/{k} of the samples")
    n = found.get(Coupling.PAIRS.value, 0)
    if n:
        parts.append(f"in-batch pairs ({n} product{'s' * (n > 1)} over the batch's samples: a contrastive loss's "
                     f"similarities, pairwise distances) meet 1/{k} of the other samples")
    n = found.get(Coupling.BATCH_STATISTICS.value, 0)
    if n:
        parts.append(f"statistics of the batch ({n} over its samples: a mean fed back to each, a variance, a norm) are "
                     f"taken over 1/{k} of the samples")
    return "; ".join(parts)
