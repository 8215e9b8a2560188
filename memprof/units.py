"""Byte formatting for display. Internally memprof counts integer bytes."""

from __future__ import annotations

__all__ = ["GiB", "MiB", "KiB", "fmt_bytes"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def fmt_bytes(n: int | float | None) -> str:
    """``1536 -> '1.50 KiB'``: base-2 units, named as such."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"
