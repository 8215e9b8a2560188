"""Which truth a script's check raises on.

A truth of values the simulation does not follow is made up (``memprof.values``): ``all()``
False, so a decoding loop's ``if done.all(): break`` runs on to its length; ``any()`` True, so
``if not mask.any(): continue`` routes tokens to every expert. A check on real values is the
other common use of a truth, and there the made-up answer stops the script: DETR's
``if not (boxes[:, 2:] >= boxes[:, :2]).all(): raise ValueError(...)``,
``assert (x >= 0).all()``, ``if (lengths > max_len).any(): raise``. A check passes on the
script's real data (it ran on a GPU before), so the simulation answers it as passing.

A check is recognised from the calling frame's bytecode, not its source: the truth is tested
by a conditional jump (``POP_JUMP_IF_TRUE``/``FALSE``, after ``TO_BOOL`` from Python 3.13), and
one of the jump's two ways raises (``RAISE_VARARGS``) before it branches again. Anything
else (a loop's exit, a truth stored, a branch with work in it) gets the made-up answer.
"""
from __future__ import annotations

import dis
import functools
import os
import sys
import types

import torch

__all__ = ["raising_truth"]

_JUMPS = {"POP_JUMP_IF_TRUE": True, "POP_JUMP_FORWARD_IF_TRUE": True, "POP_JUMP_BACKWARD_IF_TRUE": True,
          "JUMP_IF_TRUE_OR_POP": True,
          "POP_JUMP_IF_FALSE": False, "POP_JUMP_FORWARD_IF_FALSE": False, "POP_JUMP_BACKWARD_IF_FALSE": False,
          "JUMP_IF_FALSE_OR_POP": False}
#: Between the call that makes a truth and the jump that tests it: the conversion to bool
#: (3.13+), a ``not``, the branch marker (3.14+), and the interpreter's inline caches.
_ON_THE_WAY = {"TO_BOOL", "UNARY_NOT", "NOT_TAKEN", "CACHE"}
#: Frames between the script's test and the simulated device's answer: memprof's own and
#: torch's torch-function plumbing.
_PLUMBING = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
             os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "overrides.py"),
             os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "_tensor.py"))


@functools.lru_cache(maxsize=256)
def _instructions(code: types.CodeType) -> tuple[list[dis.Instruction], dict[int, int]]:
    instructions = list(dis.get_instructions(code))
    return instructions, {ins.offset: n for n, ins in enumerate(instructions)}


def _raises_at_once(instructions: list[dis.Instruction], n: int) -> bool:
    """Whether the straight-line code from instruction ``n`` raises before it jumps or returns
    (a raise's message may be an f-string or a call; a conditional in it is a jump: not at once)."""
    for ins in instructions[n:]:
        if ins.opname in ("RAISE_VARARGS", "RERAISE"):
            return True
        if "JUMP" in ins.opname or ins.opname.startswith("RETURN") or ins.opname in ("FOR_ITER", "YIELD_VALUE",
                                                                                      "SEND"):
            return False
    return False


def _caller() -> types.FrameType | None:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_PLUMBING):
        frame = frame.f_back
    return frame


def raising_truth(after_call: bool = False) -> bool | None:
    """The truth on which the script's test being evaluated raises at once, or None where it
    is no such check. ``after_call``: the truth is a call's result (``.item()``), tested by the
    instructions after the call; else the frame is at the test itself (``bool(tensor)``)."""
    frame = _caller()
    if frame is None:
        return None
    instructions, at = _instructions(frame.f_code)
    n = at.get(frame.f_lasti)
    if n is None:
        return None
    n += after_call
    negated = False
    while n < len(instructions) and instructions[n].opname in _ON_THE_WAY:
        negated ^= instructions[n].opname == "UNARY_NOT"
        n += 1
    if n >= len(instructions) or instructions[n].opname not in _JUMPS:
        return None
    target = at.get(instructions[n].argval)
    if target is None:
        return None
    if _raises_at_once(instructions, target) == _raises_at_once(instructions, n + 1):
        return None  # both ways raise, or neither: no check
    jumps_on = _JUMPS[instructions[n].opname]
    tested = jumps_on if _raises_at_once(instructions, target) else not jumps_on
    return tested != negated
