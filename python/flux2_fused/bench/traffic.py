"""The bytes a step's fused kernels move, counted at their launches.

Each launch reads or writes each of its tensor arguments once (the kernels are single-pass: a row's
inputs read, its outputs written), so the bytes a launch moves are its tensor arguments' elements
(not their storages: a launch reads q and k as strided views of one projection's output). Counted
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


def launch_bytes(args: Iterable[object]) -> int:
    """The bytes a launch with these arguments moves: its tensors' elements, each once."""
    return sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))


class _Counted:
    """A kernel module whose every function adds its launch's bytes to `totals` before running it."""

    def __init__(self, module: Any, totals: list[int]) -> None:
        self._module = module
        self._totals = totals

    def __getattr__(self, name: str) -> Callable[..., Any]:
        function = getattr(self._module, name)

        def counted(*args: Any) -> Any:
            self._totals.append(launch_bytes(args))
            return function(*args)

        return counted


@contextmanager
def _counting(totals: list[int]) -> Iterator[None]:
    """Within it, every fused kernel's launch (each reaches its module through `jit.module_for`)
    appends its bytes to `totals`."""
    module_for = jit.module_for
    jit.module_for = lambda spec, device: _Counted(module_for(spec, device), totals)
    try:
        yield
    finally:
        jit.module_for = module_for


def fused_bytes(step: Callable[[], object]) -> int:
    """The bytes the fused kernels' launches move in one `step()`."""
    totals: list[int] = []
    with _counting(totals):
        step()
    return sum(totals)
