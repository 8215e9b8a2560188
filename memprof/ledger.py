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


# The ledger keeps an entry as a tuple (category's index, module, detail,
# bytes), which the garbage collector stops tracking, unlike an Entry or a
# tuple holding a Category (see Ledger); get() answers an Entry.
_CATEGORIES: tuple[Category, ...] = tuple(Category)
_INDEX: dict[Category, int] = {c: i for i, c in enumerate(_CATEGORIES)}


class Ledger:
    """Live storages by category, with running totals that are O(1) to read.

    While a journal is open (:meth:`open_journal`), every change to the totals
    is also appended to it, so the bytes of each module and category at an
    earlier moment (a :meth:`mark`) can be rebuilt afterwards
    (:meth:`by_module`): the tracker learns which moment was the step's peak
    only once the step is over, and copying a per-module table at every
    sample would cost more than one list append per change.

    A profiled step records thousands of storages and changes that live until
    its end, and every object that lives that long brings the garbage
    collector's next scan of the whole heap closer (at a few hundred ms for a
    large model's process). So neither an entry nor a change is an object the
    collector tracks: an entry is a tuple of ints and strings, the journal
    one flat list of four items a change (category, module, detail, bytes), and
    every weak reference calls back the same bound method.
    """

    def __init__(self, block: int = 1) -> None:
        # CUDA's caching allocator hands out 512-byte multiples
        # (c10/cuda/CUDACachingAllocator.cpp, round_size), and
        # torch.cuda.memory_allocated() counts those rounded blocks.
        self.block = block
        self._entries: dict[weakref.ref, tuple[int, str, str, int]] = {}
        self.totals: dict[Category, int] = defaultdict(int)
        self._journal: list[Category | str | int] | None = None
        self._on_free = self._forget
        # Bytes of a category that no storage of ours holds (see set_fixed).
        self._fixed: dict[Category, int] = {}

    def _change(self, category: Category, module: str, nbytes: int, detail: str = "") -> None:
        self.totals[category] += nbytes
        if self._journal is not None:
            self._journal += (category, module, detail, nbytes)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, storage: torch.UntypedStorage) -> bool:
        return weakref.ref(storage) in self._entries

    def get(self, storage: torch.UntypedStorage) -> Entry | None:
        e = self._entries.get(weakref.ref(storage))
        return Entry(_CATEGORIES[e[0]], e[1], e[2], e[3]) if e is not None else None

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
            index, old_module, old_detail, nbytes = old
            if not replace or (_CATEGORIES[index] is category and old_module == module):
                return 0
            self._change(_CATEGORIES[index], old_module, -nbytes, old_detail)
            entries[key] = (_INDEX[category], module, detail, nbytes)  # the dict keeps its key, with the callback
            self._change(category, module, nbytes, detail)
            return nbytes
        nbytes = storage_bytes(storage, self.block)
        entries[weakref.ref(storage, self._on_free)] = (_INDEX[category], module, detail, nbytes)
        self.totals[category] += nbytes  # _change, inlined: this runs for every saved tensor
        if self._journal is not None:
            self._journal += (category, module, detail, nbytes)
        return nbytes

    def resize(self, storage: torch.UntypedStorage) -> None:
        """Re-read the size of a storage that was resized in place (FSDP frees
        and re-fills gathered parameters with ``storage.resize_``)."""
        key = weakref.ref(storage)
        entry = self._entries.get(key)
        if entry is not None:
            index, module, detail, old = entry
            nbytes = storage_bytes(storage, self.block)
            if nbytes != old:
                self._change(_CATEGORIES[index], module, nbytes - old, detail)
                self._entries[key] = (index, module, detail, nbytes)

    def _forget(self, key: weakref.ref) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            category = _CATEGORIES[entry[0]]
            self.totals[category] -= entry[3]  # _change, inlined
            if self._journal is not None:
                self._journal += (category, entry[1], entry[2], -entry[3])

    def set_fixed(self, category: Category, nbytes: int) -> None:
        """Attribute ``nbytes`` to ``category`` without a storage (memory a
        library holds, e.g. cuBLAS's workspaces), in place of the last such amount."""
        delta = nbytes - self._fixed.get(category, 0)
        if delta:
            self._fixed[category] = nbytes
            self._change(category, "", delta)

    def fixed(self, category: Category) -> int:
        """The bytes :meth:`set_fixed` attributes to ``category``."""
        return self._fixed.get(category, 0)

    def addresses(self) -> set[int]:
        """The device addresses of the recorded storages that are still alive."""
        out = set()
        for key in list(self._entries):
            storage = key()
            if storage is not None:
                out.add(storage.data_ptr())
        return out

    def attributed(self) -> int:
        return sum(self.totals.values())

    def snapshot(self) -> dict[Category, int]:
        """Current bytes per category (a copy, safe to keep)."""
        return {c: b for c, b in self.totals.items() if b}

    def group(self, category: Category, by: str = "module", mark: int | None = None) -> dict[str, int]:
        """Bytes of one category grouped by ``module`` or ``detail``: now, or as they were at ``mark``."""
        index, field = _INDEX[category], {"module": 1, "detail": 2}[by]
        out: dict[str, int] = defaultdict(int)
        for entry in list(self._entries.values()):
            if entry[0] == index:
                out[entry[field]] += entry[3]
        journal = self._journal
        if mark is not None and journal is not None:
            for i in range(mark, len(journal), 4):  # undo what came after the mark
                if journal[i] is category:
                    out[journal[i + field]] -= journal[i + 3]
        return {k: b for k, b in out.items() if b}

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
        for index, module, _, nbytes in list(self._entries.values()):
            out[(module, _CATEGORIES[index])] += nbytes
        for category, nbytes in self._fixed.items():
            out[("", category)] += nbytes
        journal = self._journal
        if mark is not None and journal is not None:
            for i in range(mark, len(journal), 4):  # undo what came after the mark
                out[(journal[i + 1], journal[i])] -= journal[i + 3]
        return {k: b for k, b in out.items() if b}

    def drop(self, *categories: Category) -> None:
        """Forget every entry of ``categories`` (their storages stay untouched)."""
        dropped = {_INDEX[c] for c in categories}
        for key, (index, module, _, nbytes) in list(self._entries.items()):
            if index in dropped:
                del self._entries[key]
                self._change(_CATEGORIES[index], module, -nbytes)

    def clear(self) -> None:
        self._entries.clear()
        self._fixed.clear()
        self.totals.clear()
        self._journal = None
