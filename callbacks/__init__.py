"""Trainer integrations, installed as ``memprof.callbacks``."""

__all__: list[str] = []
