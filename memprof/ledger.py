"""The ledger: which live storage belongs to which category and module.

Attribution is by storage, not by tensor, so views, tied weights and a tensor
saved twice are counted once. Storages are held by weak reference only: the
ledger never keeps user memory alive, and an entry disappears the moment its
storage is freed (PyTorch keeps one Python object per storage alive as long as
the storage lives, so a weak reference to it dies exactly with the memory).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from typing import Iterator
from dataclasses import dataclass

import torch

from .categories import Category

__all__ = ["Entry", "Ledger", "storage_bytes"]


def storage_bytes(storage: torch.UntypedStorage, block: int = 1) -> int:
    """Bytes a storage occupies in an allocator that hands out ``block``-byte multiples."""
    n = storage.nbytes()
    return -(-n // block) * block


@dataclass(slots=True)
class Entry:
    category: Category
    module: str
    detail: str
    nbytes: int


class Ledger:
    """Live storages by category, with running totals that are O(1) to read.

    While a journal is open (:meth:`open_journal`), every change to the totals
    is also appended to it, so the bytes of each module and category at an
    earlier moment (a :meth:`mark`) can be rebuilt afterwards
    (:meth:`by_module`): the tracker learns which moment was the step's peak
    only once the step is over, and copying a per-module table at every
    sample would cost more than one list append per change.
    """

    def __init__(self, block: int = 1) -> None:
        # CUDA's caching allocator hands out 512-byte multiples
        # (c10/cuda/CUDACachingAllocator.cpp, round_size), and
        # torch.cuda.memory_allocated() counts those rounded blocks.
        self.block = block
        self._entries: dict[weakref.ref, Entry] = {}
        self.totals: dict[Category, int] = defaultdict(int)
        self._journal: list[tuple[Category, str, int]] | None = None

    def _change(self, category: Category, module: str, nbytes: int) -> None:
        self.totals[category] += nbytes
        if self._journal is not None:
            self._journal.append((category, module, nbytes))

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, storage: torch.UntypedStorage) -> Entry | None:
        return self._entries.get(weakref.ref(storage))

    def add(
        self,
        storage: torch.UntypedStorage,
        category: Category,
        module: str = "",
        detail: str = "",
        *,
        replace: bool = False,
    ) -> int:
        """Record ``storage``; return the bytes newly attributed (0 if known).

        With ``replace``, a storage already recorded under another category is
        moved (a gradient of an activation that becomes a parameter's ``.grad``).
        """
        entries = self._entries
        key = weakref.ref(storage)
        old = entries.get(key)
        if old is not None:
            if not replace or (old.category is category and old.module == module):
                return 0
            self._change(old.category, old.module, -old.nbytes)
            old.category, old.module, old.detail = category, module, detail
            self._change(category, module, old.nbytes)
            return old.nbytes
        nbytes = storage_bytes(storage, self.block)
        entries[weakref.ref(storage, self._forget)] = Entry(category, module, detail, nbytes)
        self.totals[category] += nbytes  # _change, inlined: this runs for every saved tensor
        if self._journal is not None:
            self._journal.append((category, module, nbytes))
        return nbytes

    def resize(self, storage: torch.UntypedStorage) -> None:
        """Re-read the size of a storage that was resized in place (FSDP frees
        and re-fills gathered parameters with ``storage.resize_``)."""
        entry = self._entries.get(weakref.ref(storage))
        if entry is not None:
            nbytes = storage_bytes(storage, self.block)
            if nbytes != entry.nbytes:
                self._change(entry.category, entry.module, nbytes - entry.nbytes)
                entry.nbytes = nbytes

    def _forget(self, key: weakref.ref) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.totals[entry.category] -= entry.nbytes  # _change, inlined
            if self._journal is not None:
                self._journal.append((entry.category, entry.module, -entry.nbytes))

    def attributed(self) -> int:
        return sum(self.totals.values())

    def snapshot(self) -> dict[Category, int]:
        """Current bytes per category (a copy, safe to keep)."""
        return {c: b for c, b in self.totals.items() if b}

    def group(self, category: Category, by: str = "module") -> dict[str, int]:
        """Bytes of one category grouped by ``module`` or ``detail``."""
        out: dict[str, int] = defaultdict(int)
        for entry in list(self._entries.values()):
            if entry.category is category:
                out[getattr(entry, by)] += entry.nbytes
        return dict(out)

    # -- the journal -----------------------------------------------------------
    def open_journal(self) -> None:
        """Start recording every change (a profiled step begins)."""
        self._journal = []

    def close_journal(self) -> None:
        self._journal = None

    @contextlib.contextmanager
    def backdated(self) -> Iterator[None]:
        """Changes made inside count as made before the journal opened: every
        :meth:`by_module` of an earlier mark includes them."""
        journal, self._journal = self._journal, None
        try:
            yield
        finally:
            self._journal = journal

    def mark(self) -> int:
        """A moment to rebuild later with :meth:`by_module` (0 without a journal)."""
        return len(self._journal) if self._journal is not None else 0

    def by_module(self, mark: int | None = None) -> dict[tuple[str, Category], int]:
        """Bytes per (module, category): now, or as they were at ``mark``.

        The sum over modules of one category equals ``totals`` at that moment
        exactly: both follow the same changes.
        """
        out: dict[tuple[str, Category], int] = defaultdict(int)
        for entry in list(self._entries.values()):
            out[(entry.module, entry.category)] += entry.nbytes
        if mark is not None and self._journal is not None:
            for category, module, nbytes in self._journal[mark:]:  # undo what came after the mark
                out[(module, category)] -= nbytes
        return {k: b for k, b in out.items() if b}

    def drop(self, *categories: Category) -> None:
        """Forget every entry of ``categories`` (their storages stay untouched)."""
        for key, entry in list(self._entries.items()):
            if entry.category in categories:
                del self._entries[key]
                self._change(entry.category, entry.module, -entry.nbytes)

    def clear(self) -> None:
        self._entries.clear()
        self.totals.clear()
        self._journal = None
