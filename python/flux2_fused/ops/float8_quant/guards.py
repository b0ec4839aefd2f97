"""Why the float8 quantization kernel cannot take a call: the checks, in words.

The kernel reproduces torchao's chain (`reference`) for contiguous rows (any number of leading
dims) of one 16-bit float dtype on one CUDA device, K a multiple of 8 (up to 24576 with a scale a row:
a row held by one block in registers), at least one row, 16-byte-aligned data and no autograd, with
a scale a row ("row") or one for the tensor ("tensor"), for which the kernel that wrote x may have
left its amax words. Everything else declines to the eager chain. The verdicts are per (device,
dtype, granularity) self-check.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import runtime
from ..verdicts import Guard, Reason, TypeReason, call_reason
from .reference import GRANULARITIES
from .selfcheck import OP, Config

SUPPORTED_DTYPES = runtime.SUPPORTED_DTYPES
MAX_COLS = 256 * 12 * 8  # a block's threads x the vectors a thread holds x 8 elements
ALIGN = 16  # bytes: the kernel loads 8 elements at a time


def metadata_reason(x: Any, granularity: Any = "row", words: Any = None) -> Reason:
    """Everything x's (and the words') type, shape, strides, dtype and device and the granularity
    decide."""
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
    if cols % 8:
        return f"K={cols} is not a multiple of 8"
    if granularity == "row" and cols > MAX_COLS:
        return f"K={cols} is more than {MAX_COLS}, the widest row a block holds"
    return None if words is None else words_reason(x, granularity, words)


def words_reason(x: torch.Tensor, granularity: str, words: Any) -> Reason:
    """Why `words` cannot be x's amax words: a whole-tensor scale's, as one int32 word a row or more
    (contiguous, on x's device)."""
    if granularity != "tensor":
        return "amax words are a whole-tensor scale's"
    if not isinstance(words, torch.Tensor):
        return TypeReason("words is not a tensor")
    if words.dtype != torch.int32 or words.device != x.device:
        return TypeReason(f"words are {words.dtype} on {words.device}, need int32 on {x.device}")
    if words.dim() != 1 or words.numel() == 0 or not words.is_contiguous():
        return f"words {tuple(words.shape)} are not one contiguous run of words"
    return None


def decline_reason(x: Any, granularity: Any = "row", words: Any = None) -> Reason:
    """Why the fused quantization declines x (with the amax words its kernel left), or None when it
    launches the kernel."""
    reason = metadata_reason(x, granularity, words) or call_reason(["x"], [x], ALIGN)
    if reason is not None:
        return reason
    return runtime.runtime_reason(OP, x.device, Config(x.dtype, granularity))


def _runtime_reason(granularity: str):
    """The runtime part of `granularity`'s guards: kill switch, kernel build, its self-check."""
    return lambda x, *_: runtime.runtime_reason(OP, x.device, Config(x.dtype, granularity))


# The memoized guards `accepts` asks, by (granularity, whether amax words come with x): a float8
# step quantizes a hundred activations, so the metadata verdict is remembered as every op's is.
_GUARDS = {
    (kind, False): Guard(("x",), lambda x, kind=kind: metadata_reason(x, kind), _runtime_reason(kind), ALIGN)
    for kind in GRANULARITIES
}
_GUARDS["tensor", True] = Guard(
    ("x", "words"), lambda x, words: metadata_reason(x, "tensor", words), _runtime_reason("tensor"), ALIGN
)


def accepts(x: Any, granularity: Any = "row", words: Any = None) -> bool:
    """`decline_reason(x, granularity, words) is None`, with the metadata verdict remembered. Never
    raises."""
    guard = _GUARDS.get((granularity, words is not None))
    if guard is None:  # an unknown granularity, or words with a scale a row
        return False
    return guard(x) if words is None else guard(x, words)
