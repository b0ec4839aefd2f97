"""Why the uniform-rows kernel cannot check a tensor: the checks, in words.

The kernel compares [B, S, W] / [S, W] rows of one 16-bit float dtype on one CUDA device, 16 bytes at
a time: W, the strides and the data must be multiples of 16 bytes. A proof is made only of a
contiguous tensor (what a Linear returns), so that any view of its columns and rows can be matched
against it by its strides and offset alone (`UniformRows.word`).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import runtime
from ..verdicts import Guard, Reason, TypeReason
from .selfcheck import OP, Config

SUPPORTED_DTYPES = runtime.SUPPORTED_DTYPES
ALIGN = 16  # bytes: the kernel compares 16 bytes at a time


def metadata_reason(x: Any) -> Reason:
    """Everything x's type, shape, strides, dtype and device decide."""
    if not isinstance(x, torch.Tensor):
        return TypeReason("x is not a tensor")
    if x.device.type != "cuda":
        return TypeReason(f"x is on {x.device}, the kernel needs CUDA")
    if x.dtype not in SUPPORTED_DTYPES:
        return TypeReason(f"dtype {x.dtype} is not supported (bfloat16, float16)")
    if x.dim() not in (2, 3):
        return f"x must be [B, S, W] or [S, W], got {tuple(x.shape)}"
    if not x.is_contiguous():
        return "x is not contiguous"
    if (x.shape[-1] * x.element_size()) % ALIGN:
        return f"a row of x is not a multiple of {ALIGN} bytes"
    return None


def _runtime_reason(x: torch.Tensor) -> Reason:
    return runtime.runtime_reason(OP, x.device, Config(x.dtype))


check = Guard(("x",), metadata_reason, _runtime_reason, ALIGN)


def decline_reason(x: Any) -> Reason:
    """Why `uniform_rows.check(x)` makes no proof, or None when it launches the kernel."""
    return check.reason(x)
