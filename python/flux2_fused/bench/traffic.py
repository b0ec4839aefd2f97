"""The bytes a step's fused kernels move, counted at their launches.

Each launch reads or writes each of its tensor arguments once (the kernels are single-pass: a row's
inputs read, its outputs written), so the bytes a launch moves are its tensor arguments' elements
(not their storages: a launch reads q and k as strided views of one projection's output); an op
whose kernels read some arguments only in part, or twice, says how much itself (`MOVED`:
gated_resnorm reads per-token modulation rows proven equal once a batch; float8_quant reads x twice
where it reduces a tensor's amax). Counted over one step by op and set against each op's kernel time
in a profiled step, they give each op's bandwidth where the model runs it, at the model's shapes and
with its inputs as the kernels before left them, beside the kernel benchmark's figures for one shape
timed alone: how far the step's fused kernels are from the copy bandwidth, the one thing their
distance above the floor can still shrink by.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..ops import jit
from ..ops.float8_quant.launch import SPEC as FLOAT8_QUANT
from ..ops.float8_quant.launch import moved_bytes as float8_quant_bytes
from ..ops.gated_resnorm.launch import SPEC as GATED_RESNORM
from ..ops.gated_resnorm.launch import moved_bytes as gated_resnorm_bytes


def launch_bytes(args: Iterable[object]) -> int:
    """The bytes a launch with these arguments moves: its tensors' elements, each once."""
    return sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))


# The ops whose launches move other than every tensor argument's elements, by module name.
MOVED: dict[str, Callable[[Any], int]] = {
    GATED_RESNORM.name: gated_resnorm_bytes,
    FLOAT8_QUANT.name: float8_quant_bytes,
}


class _Counted:
    """A kernel module whose every function hands its launch's bytes to `note` before running it."""

    def __init__(self, module: Any, note: Callable[[int], None], moved: Callable[[Any], int]) -> None:
        self._module = module
        self._note = note
        self._moved = moved

    def __getattr__(self, name: str) -> Callable[..., Any]:
        function = getattr(self._module, name)

        def counted(*args: Any) -> Any:
            self._note(self._moved(args))
            return function(*args)

        return counted


@contextmanager
def counting(note: Callable[[str, int], None]) -> Iterator[None]:
    """Within it, every fused kernel's launch (each reaches its module through `jit.module_for`)
    hands its op's name (its kernel spec's) and its bytes to `note`, in launch order, then runs."""
    module_for = jit.module_for

    def counted(spec: Any, device: Any) -> _Counted:
        op = getattr(spec, "name", "")
        return _Counted(module_for(spec, device), functools.partial(note, op), MOVED.get(op, launch_bytes))

    jit.module_for = counted
    try:
        yield
    finally:
        jit.module_for = module_for


def bytes_by_op(step: Callable[[], object]) -> dict[str, int]:
    """The bytes the fused kernels' launches move in one `step()`, by op, in the order each op first
    launched."""
    totals: dict[str, int] = {}

    def note(op: str, nbytes: int) -> None:
        totals[op] = totals.get(op, 0) + nbytes

    with counting(note):
        step()
    return totals
