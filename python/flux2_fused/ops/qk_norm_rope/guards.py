"""Why the qk_norm_rope kernel cannot take a segment: the checks, in words, and the boolean guards.

The kernel reproduces eager for q and k segments x [B, S, H, 128] whose heads are dense (any row and
batch stride that keeps 16-byte alignment: the single block's q and k are chunks of one wide
projection), with a [128] RMSNorm weight of x's dtype and fp32 [S_total, 128] RoPE tables (or one
a batch), and for v segments of the same layout (copied only); one 16-bit float dtype on one CUDA
device, 16-byte-aligned data (the kernel moves 16 bytes a lane; aten's vectorized RMSNorm needs 8) and
no autograd. In the upcast mode (FLUX.3: `norm(x.float())`, RoPE in fp32, one rounding) the weight is
float32 instead, as aten's fused RMSNorm needs for fp32 rows (any other dtype runs its composite
chain), and 16-byte aligned, as its float kernel needs. The host's rotation (`reference.ROTATIONS`)
and q/k norm (`reference.NORMS`) change no check, only which self-check vouches: diffusers' `RMSNorm`
("mean") rounds to its weight's dtype before the weight multiplies, so there too the weight has x's
dtype. Everything else declines to the eager chain. `segment_guard` guards one q or k segment in a
mode, `value_guard` one v segment; what one launch needs across them is `_layout_reason` in the
package's `__init__`.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import runtime
from ..verdicts import Guard, Reason, TypeReason
from .reference import NORMS, ROTATIONS
from .selfcheck import HEAD_DIM, OP, Config

SUPPORTED_DTYPES = runtime.SUPPORTED_DTYPES


def _x_reason(x: Any, name: str = "x") -> Reason:
    """The layout of one input's rows (`name` as the message calls it): dense heads of 128, 16-byte
    rows, a supported dtype on CUDA."""
    if not isinstance(x, torch.Tensor):
        return TypeReason(f"{name} is not a tensor")
    if x.dim() != 4:
        return f"{name} must be [B, S, H, head_dim], got {tuple(x.shape)}"
    if x.shape[-1] != HEAD_DIM:
        return f"head_dim {x.shape[-1]} is not {HEAD_DIM} (the kernel reproduces aten's reduction for 128)"
    if x.stride(-1) != 1 or (x.shape[-2] > 1 and x.stride(-2) != HEAD_DIM):
        return f"{name} heads are not dense (needs strides (..., 128, 1))"
    for axis, stride in ((1, "row"), (0, "batch")):
        if x.shape[axis] > 1 and x.stride(axis) % 8 != 0:
            return f"{name} {stride} stride {x.stride(axis)} is not a multiple of 8 elements"
    if x.device.type != "cuda":
        return TypeReason(f"{name} is on {x.device}, the fused kernel needs CUDA")
    if x.dtype not in SUPPORTED_DTYPES:
        return TypeReason(f"dtype {x.dtype} is not supported (bfloat16, float16)")
    return None


def _table_reason(name: str, t: Any, x: Any) -> Reason:
    """A RoPE table: contiguous fp32 [S, 128], or one for each of x's batch rows [B (or 1), S, 128]."""
    if not isinstance(t, torch.Tensor):
        return TypeReason(f"{name} is not a tensor")
    if t.dtype != torch.float32:
        return TypeReason(f"{name} is {t.dtype}, the RoPE tables are float32")
    if t.dim() not in (2, 3) or t.shape[-1] != HEAD_DIM or not t.is_contiguous():
        return f"{name} must be a contiguous [S, 128] or [B, S, 128] table, got {tuple(t.shape)}"
    if t.dim() == 3 and t.shape[0] not in (1, x.shape[0]):
        return f"{name} has {t.shape[0]} batch rows, x {x.shape[0]}"
    return None


def _metadata_reason(x: Any, weight: Any, cos: Any, sin: Any, upcast: bool = False) -> Reason:
    """Everything the tensors' shapes, strides, dtypes and devices decide for one segment; `upcast`:
    FLUX.3's mode, whose norm runs on x.float() with a float32 weight."""
    reason = _x_reason(x) or _table_reason("cos", cos, x) or _table_reason("sin", sin, x)
    if reason is not None:
        return reason
    if not isinstance(weight, torch.Tensor):
        return TypeReason("weight is not a tensor")
    if weight.shape != (HEAD_DIM,) or weight.stride(0) != 1:
        return f"weight must be a dense [{HEAD_DIM}] vector, got {tuple(weight.shape)}"
    if upcast and weight.dtype != torch.float32:
        # fp32 rows with a weight of another dtype run rms_norm's composite chain, not the fused kernel
        return TypeReason(
            f"weight is {weight.dtype}, the upcast rows are torch.float32 (eager would promote)"
        )
    if not upcast and weight.dtype != x.dtype:
        return TypeReason(f"weight is {weight.dtype}, x is {x.dtype} (eager would promote)")
    for name, t in (("weight", weight), ("cos", cos), ("sin", sin)):
        if t.device != x.device:
            return TypeReason(f"{name} is on {t.device}, x on {x.device}")
    if cos.shape != sin.shape:
        return f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ"
    return None


# aten's mean keeps a row in one warp (the layout the "mean" norm reproduces) where a call has at least
# this many rows; with fewer, its reduction spreads a row over more threads (sandwich_norm alike).
MEAN_MIN_ROWS = 16


def _rows_reason(x: torch.Tensor) -> Reason:
    """diffusers' RMSNorm reduces the segment's B * S * H head rows in one call: too few of them and
    aten's mean sums a row in another order."""
    rows = x.shape[0] * x.shape[1] * x.shape[2]
    if rows < MEAN_MIN_ROWS:
        return (
            f"{rows} head rows in the segment: aten's mean sums a row in one warp from {MEAN_MIN_ROWS} rows"
        )
    return None


def _mode_guards(upcast: bool, rotation: str, norm: str) -> tuple[Guard, Guard]:
    """The (segment, value) guards of one mode: its metadata checks, and the kill switch, kernel
    build and self-check of this (device, dtype) in that mode."""
    config = {"upcast": upcast, "rotation": rotation, "norm": norm}

    def runtime_reason(x: torch.Tensor, *_: Any) -> Reason:
        return runtime.runtime_reason(OP, x.device, Config(x.dtype, **config))

    # align=16: the kernel's loads are 16 bytes; aten's vectorized RMSNorm needs 8 (16-bit rows and
    # weight) or 16 (the upcast mode's float32 weight), else it runs another reduction.
    segment = Guard(
        ("x", "weight", "cos", "sin"),
        lambda *args: (
            _metadata_reason(*args, upcast=upcast) or (_rows_reason(args[0]) if norm == "mean" else None)
        ),
        runtime_reason,
        align=16,
    )
    value = Guard(("v",), lambda v: _x_reason(v, "v"), runtime_reason, align=16)
    return segment, value


# The modes: (upcast, rotation, norm) -> (segment guard, value guard). FLUX.3's upcast mode is
# diffusers' rotation and aten's norm only; diffusers' `RMSNorm` goes with the complex rotation
# (Qwen-Image's and Z-Image's prologue), and only there.
MODES = (
    (False, "aten", "fused"),
    (False, "addcmul", "fused"),
    (False, "kitchen", "fused"),
    (True, "aten", "fused"),
    (False, "complex", "mean"),
)
_GUARDS = {mode: _mode_guards(*mode) for mode in MODES}
segment, value = _GUARDS[False, "aten", "fused"]
upcast_segment, upcast_value = _GUARDS[True, "aten", "fused"]


def mode_reason(upcast: Any, rotation: Any, norm: Any = "fused") -> str | None:
    """Why (upcast, rotation, norm) is not a mode of the kernel, or None."""
    if rotation not in ROTATIONS:
        return f"rotation {rotation!r} is not one of {ROTATIONS}"
    if norm not in NORMS:
        return f"norm {norm!r} is not one of {NORMS}"
    if upcast and (rotation, norm) != ("aten", "fused"):
        return "the upcast mode rotates and normalizes as FLUX.3 does (rotation 'aten', norm 'fused')"
    if (norm == "mean") != (rotation == "complex"):
        return "diffusers' RMSNorm ('mean') is fused with the complex rotation only, and it with that norm"
    return None


def _mode_guards_of(upcast: bool, rotation: str, norm: str) -> tuple[Guard, Guard]:
    reason = mode_reason(upcast, rotation, norm)
    if reason is not None:
        raise ValueError(f"flux2-fused: {reason}")
    return _GUARDS[bool(upcast), rotation, norm]


def segment_guard(upcast: bool = False, rotation: str = "aten", norm: str = "fused") -> Guard:
    """The guard of one q or k segment in this mode; ValueError for a mode the kernel has not."""
    return _mode_guards_of(upcast, rotation, norm)[0]


def value_guard(upcast: bool = False, rotation: str = "aten", norm: str = "fused") -> Guard:
    """The guard of one v segment in this mode (the same checks; the self-check of the mode);
    ValueError for a mode the kernel has not."""
    return _mode_guards_of(upcast, rotation, norm)[1]


def segment_decline_reason(
    x: Any,
    weight: Any,
    cos: Any,
    sin: Any,
    *,
    upcast: bool = False,
    rotation: str = "aten",
    norm: str = "fused",
) -> Reason:
    """Why the kernel declines this q or k segment, or None when it accepts it; `upcast`: in FLUX.3's
    mode (float32 weight, norm and RoPE in fp32); `rotation`: the host's RoPE arithmetic; `norm`: its
    q/k norm."""
    mode = (upcast, rotation, norm)
    return mode_reason(*mode) or segment_guard(*mode).reason(x, weight, cos, sin)


def value_decline_reason(
    v: Any, *, upcast: bool = False, rotation: str = "aten", norm: str = "fused"
) -> Reason:
    """Why the kernel declines this v segment, or None when it accepts it."""
    return mode_reason(upcast, rotation, norm) or value_guard(upcast, rotation, norm).reason(v)
