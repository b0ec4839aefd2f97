"""Why the float8 quantization kernel cannot take a call: the checks, in words.

The kernel reproduces torchao's chain (`reference`) for contiguous rows (any number of leading
dims) of one 16-bit float dtype on one CUDA device, K a multiple of 8 up to 24576 (a row held by one
block in registers), at least one row, 16-byte-aligned data and no autograd, with a scale a row
("row") or one for the tensor ("tensor"). Everything else declines to the eager chain. The verdicts
are per (device, dtype, granularity) self-check.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import runtime
from ..verdicts import Reason, TypeReason, call_reason
from .reference import GRANULARITIES
from .selfcheck import OP, Config

SUPPORTED_DTYPES = runtime.SUPPORTED_DTYPES
MAX_COLS = 256 * 12 * 8  # a block's threads x the vectors a thread holds x 8 elements
ALIGN = 16  # bytes: the kernel loads 8 elements at a time


def metadata_reason(x: Any, granularity: Any = "row") -> Reason:
    """Everything x's type, shape, strides, dtype and device and the granularity decide."""
    if not isinstance(x, torch.Tensor):
        return TypeReason("x is not a tensor")
    if granularity not in GRANULARITIES:
        return f"granularity {granularity!r} is not one of {', '.join(GRANULARITIES)}"
    if x.device.type != "cuda":
        return TypeReason(f"x is on {x.device}, the fused kernel needs CUDA")
    if x.dtype not in SUPPORTED_DTYPES:
        return TypeReason(f"dtype {x.dtype} is not supported (bfloat16, float16)")
    if x.dim() == 0 or x.numel() == 0:
        return f"x {tuple(x.shape)} has no rows"
    if not x.is_contiguous():
        return "x is not contiguous"
    cols = x.shape[-1]
    if cols % 8 or cols > MAX_COLS:
        return f"K={cols} is not a multiple of 8 up to {MAX_COLS}"
    return None


def decline_reason(x: Any, granularity: Any = "row") -> Reason:
    """Why the fused quantization declines x, or None when it launches the kernel."""
    reason = metadata_reason(x, granularity) or call_reason(["x"], [x], ALIGN)
    if reason is not None:
        return reason
    return runtime.runtime_reason(OP, x.device, Config(x.dtype, granularity))
