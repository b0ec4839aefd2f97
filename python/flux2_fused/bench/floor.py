"""A step's floor: its GEMMs and attention alone, replayed from a CUDA graph.

Why: an exact fused step keeps every matrix product and the attention call exactly as eager runs
them (another GEMM kernel or reduction order changes the bits), and replaces only the work between
them. So the time of those calls alone, on the same GPU under the same clocks and power limit, is
the floor an exact step can at best reach (measured, so within the noise of a few steps); a fused
step's distance above it is what its own kernels and the GPU's idle time still cost, and a target
well below it is out of reach for any exact implementation.

Beside it, the copied step (`floor_step(..., copies=True)`) replays the same calls with, in place of
each fused launch, one device copy of the bytes that launch moves (`bench.traffic`: half read, half
written), where it ran. It times the step as if every fused kernel were the GPU's own copy of its
bytes, so it says how the fused kernels' traffic compares, in place, with the copy that the kernel
benchmark holds each kernel against: where the fused step is faster than the copied one, its
kernels move their bytes in place faster than copies of them do (a fused kernel reads what the GEMM
before it has just written, a copy a buffer of its own), and copy speed is not what bounds them
there.

`record(step, keep)` runs one step under a dispatch mode that notes each call of a GEMM or attention
operator with its arguments: tensors of the model (`keep`: its weights, held by reference) as they
are, every other tensor as a copy of its storage with the same size, strides and offset taken when
the call ran (one copy for all inputs of one layout, so a 2048x2048 batch holds a few buffers, not a
step's activations); with `fused`, each fused launch too, as the `Copy` of its bytes.
`floor_step` replays the calls from a CUDA graph, so the host's launch work is not part of it
either: the replay is GPU time only, the same kernels on the same shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from .timing import graphed
from .traffic import counting

aten = torch.ops.aten


def _overloads(names: Iterable[str]) -> frozenset:
    """The default overloads of the aten operators named, those this torch has."""
    found = (getattr(aten, name, None) for name in names)
    return frozenset(op.default for op in found if op is not None)


# The operators a step's matrix products and attention reach a dispatch mode as: whole (linear,
# matmul and SDPA under inference mode) or decomposed (their mm/addmm/bmm, the SDPA backend picked).
# Inside one of them the mode is off, so what it calls in turn (linear's addmm) is not noted twice.
GEMM_OPS = _overloads(("linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_int_mm"))
ATTENTION_OPS = _overloads(
    (
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
)
FLOOR_OPS = GEMM_OPS | ATTENTION_OPS

Call = tuple[Any, tuple, dict]


@dataclass(frozen=True)
class Copy:
    """A fused launch in a record: the bytes it moves, replayed as one device copy of them."""

    nbytes: int


Record = list[Call | Copy]
_PLAIN = (torch.Tensor, torch.nn.Parameter)


class _Recorder(TorchDispatchMode):
    """Notes every call of a FLOOR_OPS operator (see `record`) and runs every operator as usual."""

    def __init__(self, keep: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.keep = {t.untyped_storage().data_ptr() for t in keep if type(t) in _PLAIN}
        self.copies: dict[tuple, torch.Tensor] = {}
        self.calls: list[Call] = []

    def _hold(self, value: object) -> object:
        # A tensor subclass (a quantized weight, say) has no storage of its own to copy: by reference.
        if type(value) not in _PLAIN or value.untyped_storage().data_ptr() in self.keep:
            return value
        layout = (
            value.dtype,
            value.device,
            tuple(value.shape),
            value.stride(),
            value.storage_offset(),
            value.untyped_storage().nbytes(),
        )
        if layout not in self.copies:
            storage = value.untyped_storage().clone()
            copy = torch.empty(0, dtype=value.dtype, device=value.device)
            self.copies[layout] = copy.set_(storage, value.storage_offset(), value.shape, value.stride())
        return self.copies[layout]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FLOOR_OPS:
            self.calls.append((func, tree_map(self._hold, args), tree_map(self._hold, kwargs)))
        return func(*args, **kwargs)


def record(step: Callable[[], object], keep: Iterable[torch.Tensor], fused: bool = False) -> Record:
    """The GEMM and attention calls one `step()` makes, in order, with their arguments held (see the
    module docstring); `keep` are the tensors to hold by reference (the model's weights). With
    `fused`, each fused kernel launch as well, where it ran among them: the `Copy` of its bytes."""
    recorder = _Recorder(keep)
    launches = counting(lambda op, nbytes: recorder.calls.append(Copy(nbytes))) if fused else nullcontext()
    with recorder, launches:
        step()
    return recorder.calls


def replay(calls: Iterable[Call | Copy], scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """The calls again, on the GPU's current stream, results dropped; each `Copy` copies the first
    half of its bytes of `scratch[0]` into `scratch[1]` (both at least that large)."""
    for call in calls:
        if isinstance(call, Copy):
            if scratch is None:
                raise ValueError("a record with fused launches replays with scratch buffers")
            half = call.nbytes // 2
            scratch[1][:half].copy_(scratch[0][:half])
        else:
            func, args, kwargs = call
            func(*args, **kwargs)


def floor_step(
    step: Callable[[], object], model: torch.nn.Module, copies: bool = False
) -> Callable[[], None]:
    """`step`'s GEMM and attention calls captured in a CUDA graph; the callable replays them. With
    `copies`, the copied step: each of `step`'s fused launches replayed as a device copy of its
    bytes, in its place among them, from scratch buffers as large as the largest. A step without
    any GEMM or attention call (nothing to bound) raises ValueError."""
    calls = record(step, (*model.parameters(), *model.buffers()), fused=copies)
    if not any(isinstance(call, tuple) for call in calls):
        raise ValueError("the step made no GEMM or attention call to replay")
    halves = [call.nbytes // 2 for call in calls if isinstance(call, Copy)]
    scratch = None
    if halves:
        source = torch.empty(max(halves), dtype=torch.uint8, device="cuda").random_()
        scratch = (source, torch.empty_like(source))
    return graphed(lambda: replay(calls, scratch))
