"""Closed-form estimate of model-state memory: parameters, gradients, master weights, optimizer state.

Activations are not counted here (they depend on batch, sequence length and the
graph); this module answers "how many bytes do the model states take per rank?".

Per-parameter bytes (all integers; sources are the team notes in ``seeds/``):

============  =====  ====  ======  ==============================================
precision     param  grad  master  source
============  =====  ====  ======  ==============================================
fp32          4      4     0       plain FP32 training
mixed_fp16    2      4     4       seeds/000 s.8.1 table: FP16 params, FP32 master
mixed_bf16    2      4     4       copy, FP32 grads (+ Adam m, v = 18 B/param)
bf16          2      2     0       seeds/001 "内存容量与模型规模": BF16 params and
                                   grads, FP32 Adam states (2 + 2 + 8 = 12 B/param)
============  =====  ====  ======  ==============================================

Optimizer state is FP32 (seeds/000 s.8.1, seeds/001): Adam/AdamW keep m and v
(8 B/param), SGD with momentum one buffer (4 B/param), plain SGD none.

Note the ZeRO paper counts mixed precision as (2 + 2 + K)Ψ with FP16 gradients and
K = 12 (16 B/param); seeds/000 keeps FP32 gradients (as Megatron-style FP32 grad
accumulation does), hence 18 B/param here.

ZeRO sharding (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC 2020, s.5): stage 1 (P_os) shards the optimizer
state, which in the paper includes the FP32 master weights; stage 2 (P_os+g) also
shards gradients; stage 3 (P_os+g+p) also shards parameters. A sharded component
holds ``ceil(n_params / world_size)`` elements per rank: when ``world_size`` does
not divide ``n_params`` the last shard is padded, as DeepSpeed pads its flat
partitions, so the per-rank figure is an upper bound by < 1 element per component.

Offload (ZeRO-Offload, Ren et al. 2021; DeepSpeed ``offload_optimizer`` /
``offload_param``): ``"optimizer"`` moves optimizer state and master weights to
host memory, where the CPU optimizer updates them; ``"optimizer+parameters"`` moves
the parameters too. Gradients are counted on the device because backward produces
them there (DeepSpeed then streams them out in buckets, so the device figure is an
upper bound). Like DeepSpeed, optimizer offload needs ZeRO stage >= 1 and parameter
offload needs stage 3.

All figures are per rank; a node holding several ranks needs ``host_total`` times
its ranks of host memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = [
    "ModelStates",
    "estimate_model_states",
    "transformer_layer_params",
    "PRECISIONS",
    "OPTIMIZERS",
    "OFFLOADS",
]

#: precision -> (param, grad, master) bytes per parameter; see the module docstring.
PRECISIONS: dict[str, tuple[int, int, int]] = {
    "fp32": (4, 4, 0),
    "mixed_fp16": (2, 4, 4),
    "mixed_bf16": (2, 4, 4),
    "bf16": (2, 2, 0),
}

#: optimizer -> FP32 state bytes per parameter.
OPTIMIZERS: dict[str, int] = {"adamw": 8, "adam": 8, "sgd_momentum": 4, "sgd": 0}

OFFLOADS: tuple[str | None, ...] = (None, "optimizer", "optimizer+parameters")


@dataclass(frozen=True)
class ModelStates:
    """Model-state bytes on one rank.

    Each component counts its bytes wherever they live, so
    ``parameters + gradients + master_weights + optimizer_state == total + host_total``.
    ``total`` is what must fit on the device, ``host_total`` what was offloaded to
    host memory, and ``bytes_per_param`` is ``total / n_params`` (18.0 for
    mixed-precision Adam without sharding; 2.25 once ZeRO-3 splits that over 8 ranks).
    """

    parameters: int
    gradients: int
    master_weights: int
    optimizer_state: int
    total: int
    host_total: int
    bytes_per_param: float

    def to_dict(self) -> dict[str, int | float]:
        return asdict(self)


def _choice(arg: str, value, choices) -> str | None:
    """Validate a string option; case-insensitive so 'AdamW' (the torch class name) works."""
    key = value.lower() if isinstance(value, str) else value
    if not (key is None or isinstance(key, str)) or key not in choices:
        shown = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{arg}={value!r} is not supported; pass one of {shown}")
    return key


def _count(arg: str, value, minimum: int, example: str) -> int:
    """Validate an integer count; integral floats such as 7e9 are accepted."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{arg} must be an integer >= {minimum}, got {value!r}; e.g. {example}")
    return value


def estimate_model_states(
    n_params: int,
    precision: str = "fp32",
    optimizer: str = "adamw",
    zero_stage: int = 0,
    world_size: int = 1,
    offload: str | None = None,
) -> ModelStates:
    """Bytes of parameters, gradients, master weights and optimizer state per rank.

    >>> estimate_model_states(7_000_000_000, "mixed_fp16").total  # seeds/000 s.8.1
    126000000000
    """
    n_params = _count("n_params", n_params, 1, "n_params=7_000_000_000")
    precision = _choice("precision", precision, PRECISIONS)
    optimizer = _choice("optimizer", optimizer, OPTIMIZERS)
    world_size = _count("world_size", world_size, 1, "world_size=8 for 8 data-parallel ranks")
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
        raise ValueError(
            f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}; "
            "0 = no sharding, 3 = shard optimizer state, gradients and parameters"
        )
    offload = _choice("offload", offload, OFFLOADS)
    if offload == "optimizer" and zero_stage < 1:
        raise ValueError(
            f"offload='optimizer' needs zero_stage >= 1 (got zero_stage={zero_stage}); "
            "set zero_stage=1, 2 or 3, or offload=None"
        )
    if offload == "optimizer+parameters" and zero_stage != 3:
        raise ValueError(
            f"offload='optimizer+parameters' needs zero_stage=3 (got zero_stage={zero_stage}); "
            "set zero_stage=3, or use offload='optimizer'"
        )

    param_b, grad_b, master_b = PRECISIONS[precision]
    shard = -(-n_params // world_size)  # ceil: the padded per-rank partition

    def size(bytes_per_elem: int, sharded_from_stage: int) -> int:
        return bytes_per_elem * (shard if zero_stage >= sharded_from_stage else n_params)

    parts = {
        "parameters": size(param_b, 3),
        "gradients": size(grad_b, 2),
        "master_weights": size(master_b, 1),
        "optimizer_state": size(OPTIMIZERS[optimizer], 1),
    }
    on_host = {
        None: (),
        "optimizer": ("master_weights", "optimizer_state"),
        "optimizer+parameters": ("master_weights", "optimizer_state", "parameters"),
    }[offload]
    host_total = sum(parts[k] for k in on_host)
    total = sum(parts.values()) - host_total
    return ModelStates(**parts, total=total, host_total=host_total, bytes_per_param=total / n_params)


def transformer_layer_params(d_model: int, d_ff: int, n_layers: int, *, gated: bool = False) -> int:
    """Weight-matrix parameters of ``n_layers`` transformer blocks.

    Counts exactly what seeds/001 ("测量模型组件的内存占用") counts: the Q, K, V, O
    projections (4 * d_model**2) and the FFN matrices (2 * d_model * d_ff, or 3 with
    ``gated=True`` for SwiGLU-style FFNs). Biases, norms and embeddings are left out.
    """
    d_model = _count("d_model", d_model, 1, "d_model=4096")
    d_ff = _count("d_ff", d_ff, 1, "d_ff=4 * d_model")
    n_layers = _count("n_layers", n_layers, 1, "n_layers=32")
    return n_layers * (4 * d_model * d_model + (3 if gated else 2) * d_model * d_ff)
