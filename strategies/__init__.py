"""Memory-saving strategies (mixed precision, checkpointing, accumulation,
offload, ZeRO), each able to simulate and apply itself. Installed as
``memprof.strategies``."""

__all__: list[str] = []
