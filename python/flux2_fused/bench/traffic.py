"""The bytes a step's fused kernels move, counted at their launches.

Each launch reads or writes each of its tensor arguments once (the kernels are single-pass: a row's
inputs read, its outputs written), so the bytes a launch moves are its tensor arguments' elements
(not their storages: a launch reads q and k as strided views of one projection's output); an op
whose kernel reads some arguments only in part says how much itself (`MOVED`: gated_resnorm reads
per-token modulation rows proven equal once a batch). Counted
over one step and set against the fused kernels' time in a profiled step, they give the kernels'
bandwidth where the model runs them, beside the kernel benchmark's op-by-op figures: how far the
step's fused kernels are from the copy bandwidth, the one thing their distance above the floor
can still shrink by.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..ops import jit
from ..ops.gated_resnorm.launch import SPEC as GATED_RESNORM
from ..ops.gated_resnorm.launch import moved_bytes as gated_resnorm_bytes


def launch_bytes(args: Iterable[object]) -> int:
    """The bytes a launch with these arguments moves: its tensors' elements, each once."""
    return sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))


# The ops whose launches move other than every tensor argument's elements, by module name.
MOVED: dict[str, Callable[[Any], int]] = {GATED_RESNORM.name: gated_resnorm_bytes}


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
def counting(note: Callable[[int], None]) -> Iterator[None]:
    """Within it, every fused kernel's launch (each reaches its module through `jit.module_for`)
    hands its bytes to `note`, in launch order, then runs."""
    module_for = jit.module_for
    jit.module_for = lambda spec, device: _Counted(
        module_for(spec, device), note, MOVED.get(getattr(spec, "name", ""), launch_bytes)
    )
    try:
        yield
    finally:
        jit.module_for = module_for


def fused_bytes(step: Callable[[], object]) -> int:
    """The bytes the fused kernels' launches move in one `step()`."""
    totals: list[int] = []
    with counting(totals.append):
        step()
    return sum(totals)
