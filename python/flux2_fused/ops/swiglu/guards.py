"""Why the swiglu kernel cannot take a call: the checks, in words, and the boolean guard.

The kernel reproduces eager for [B, S, 2H] / [S, 2H] row views with unit inner stride (the single
block's MLP part is a strided view of one wide projection), H a positive multiple of 4, one 16-bit
float dtype on one CUDA device, 8-byte-aligned rows and no autograd; `out` (when given) is a
[..., H] view of the same rows that does not overlap x.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import runtime
from ..verdicts import Guard, Reason, TypeReason
from .selfcheck import OP, Config

SUPPORTED_DTYPES = runtime.SUPPORTED_DTYPES


def _rows_reason(name: str, t: Any) -> Reason:
    if not isinstance(t, torch.Tensor):
        return TypeReason(f"{name} is not a tensor")
    if t.dim() not in (2, 3):
        return f"{name} must be [B, S, C] or [S, C], got {tuple(t.shape)}"
    if t.stride(-1) != 1:
        return f"{name} has inner stride {t.stride(-1)} (needs 1)"
    for axis, what in ((-2, "row"), (0, "batch")):
        counts = t.dim() == 3 or axis == -2  # a 2-D view has no batch axis
        if counts and t.shape[axis] > 1 and t.stride(axis) % 4 != 0:
            return f"{name} {what} stride {t.stride(axis)} is not a multiple of 4 elements"
    return None


def _metadata_reason(x: Any, out: Any = None) -> Reason:
    """Everything the tensors' shapes, strides, dtypes and devices decide."""
    reason = _rows_reason("x", x)
    if reason is not None:
        return reason
    if x.shape[-1] % 8 != 0 or x.shape[-1] == 0:
        return f"x has {x.shape[-1]} channels, the kernel needs 2H with H a positive multiple of 4"
    if x.device.type != "cuda":
        return TypeReason(f"x is on {x.device}, the fused kernel needs CUDA")
    if x.dtype not in SUPPORTED_DTYPES:
        return TypeReason(f"dtype {x.dtype} is not supported (bfloat16, float16)")
    if out is None:
        return None
    reason = _rows_reason("out", out)
    if reason is not None:
        return reason
    if out.dtype != x.dtype or out.device != x.device:
        return TypeReason(f"out is {out.dtype} on {out.device}, x is {x.dtype} on {x.device}")
    if out.shape != (*x.shape[:-1], x.shape[-1] // 2):
        return f"out shape {tuple(out.shape)} is not x's rows at half width"
    return None


def overlap_reason(x: torch.Tensor, out: torch.Tensor) -> Reason:
    """Per call (storage is not metadata): out must not share x's storage, since blocks read and
    write rows in no fixed order."""
    if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        return "out shares storage with x"
    return None


def _runtime_reason(x: torch.Tensor, *_: Any) -> Reason:
    """Kill switch, kernel build and the self-check for this (device, dtype)."""
    return runtime.runtime_reason(OP, x.device, Config(x.dtype))


plain = Guard(("x",), _metadata_reason, _runtime_reason)
into = Guard(("x", "out"), _metadata_reason, _runtime_reason)


def decline_reason(x: Any, out: Any = None) -> Reason:
    """Why the fused swiglu declines x (and the destination out), or None when it accepts them."""
    if out is None:
        return plain.reason(x)
    return into.reason(x, out) or overlap_reason(x, out)
