"""Why the sandwich-norm kernel cannot take a call: the checks, in words.

The kernel reproduces eager for contiguous [B, S, D] rows (x, and the update where there is one) of
one 16-bit float dtype on one CUDA device, at least 16 of them and D a multiple of 128 in (128, 4096)
(where aten's mean keeps a row in one warp with the lane layout the kernel reproduces), dense [D]
weights of x's dtype, gates and scales as contiguous [B or 1, 1, D] rows of x's dtype, 8-byte-aligned
data and no autograd; a call has an update or a next norm (a weight), a gate only with an update and
a scale only with a weight. Everything else declines to the eager chain. The verdicts are per
(device, dtype, D) self-check.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import runtime
from ..verdicts import Reason, TypeReason, call_reason
from .selfcheck import OP, Config

SUPPORTED_DTYPES = runtime.SUPPORTED_DTYPES
MAX_HIDDEN = 31 * 128  # D / 128 accumulator vectors a lane, in one warp
# aten's reduction gives a row one warp (block width 32) only where a launch has at least 16 rows (its
# block height); with fewer it spreads a row over more warps and sums in another order.
MIN_ROWS = 16


def _rows_reason(name: str, t: Any, like: torch.Tensor | None = None) -> Reason:
    if not isinstance(t, torch.Tensor):
        return TypeReason(f"{name} is not a tensor")
    if like is not None and (t.shape != like.shape or t.dtype != like.dtype or t.device != like.device):
        return TypeReason(
            f"{name} {tuple(t.shape)} {t.dtype} differs from x's {tuple(like.shape)} {like.dtype}"
        )
    if t.dim() != 3:
        return f"{name} must be [B, S, D], got {tuple(t.shape)}"
    if not t.is_contiguous():
        return f"{name} is not contiguous"
    return None


def _operand_reason(
    name: str, t: Any, x: torch.Tensor, shapes: set[tuple[int, ...]], expected: str
) -> Reason:
    """A weight, gate or scale: a contiguous tensor of x's dtype and device, of one of `shapes`."""
    if not isinstance(t, torch.Tensor):
        return TypeReason(f"{name} is not a tensor")
    if t.dtype != x.dtype or t.device != x.device:
        return TypeReason(
            f"{name} is {t.dtype} on {t.device}, x {x.dtype} on {x.device} (eager would promote)"
        )
    if tuple(t.shape) not in shapes or not t.is_contiguous():
        return f"{name} must be {expected}, got {tuple(t.shape)}"
    return None


def metadata_reason(
    x: Any,
    weight: Any,
    eps: Any,
    scale: Any = None,
    update: Any = None,
    update_weight: Any = None,
    gate: Any = None,
) -> Reason:
    """Everything the arguments' types, shapes, dtypes and devices decide."""
    reason = _rows_reason("x", x)
    if reason is not None:
        return reason
    if x.device.type != "cuda":
        return TypeReason(f"x is on {x.device}, the fused kernel needs CUDA")
    if x.dtype not in SUPPORTED_DTYPES:
        return TypeReason(f"dtype {x.dtype} is not supported (bfloat16, float16)")
    hidden = x.shape[-1]
    if hidden % 128 or not 128 < hidden <= MAX_HIDDEN:
        return f"D={hidden} is not a multiple of 128 in (128, {MAX_HIDDEN}] (aten's one-warp mean)"
    rows = x.shape[0] * x.shape[1]
    if rows < MIN_ROWS:
        return f"{rows} rows: aten's mean sums a row in one warp from {MIN_ROWS} rows"
    if not isinstance(eps, float | int) or isinstance(eps, bool):
        return TypeReason("eps is not a number")
    if update is None and weight is None:
        return "a call needs an update or a next norm"
    if gate is not None and update is None:
        return "a gate needs an update"
    if scale is not None and weight is None:
        return "a scale needs a next norm"
    vector = ({(hidden,)}, f"a dense [{hidden}] vector")
    rows = ({(x.shape[0], 1, hidden), (1, 1, hidden)}, f"contiguous [{x.shape[0]}, 1, {hidden}]")
    checks = (("weight", weight, vector), ("update_weight", update_weight, vector))
    checks += (("gate", gate, rows), ("scale", scale, rows))
    for name, t, (shapes, expected) in checks:
        reason = None if t is None else _operand_reason(name, t, x, shapes, expected)
        if reason is not None:
            return reason
    if update is not None:
        if update_weight is None:
            return "an update needs its norm's weight"
        return _rows_reason("update", update, x)
    return None


# The arguments by position, as `apply` takes them (eps is not a tensor).
NAMES = ("x", "weight", "eps", "scale", "update", "update_weight", "gate")


def tensor_reason(*args: Any) -> Reason:
    """What the given tensors' metadata cannot decide: subclasses, autograd, 8-byte alignment."""
    present = [(name, t) for name, t in zip(NAMES, args, strict=True) if name != "eps" and t is not None]
    return call_reason([name for name, _ in present], [t for _, t in present])


def decline_reason(
    x: Any,
    weight: Any,
    eps: Any,
    scale: Any = None,
    update: Any = None,
    update_weight: Any = None,
    gate: Any = None,
) -> Reason:
    """Why the fused sandwich norm declines this call, or None when it launches the kernel."""
    args = (x, weight, eps, scale, update, update_weight, gate)
    reason = metadata_reason(*args) or tensor_reason(*args)
    if reason is not None:
        return reason
    return runtime.runtime_reason(OP, x.device, Config(x.dtype, x.shape[-1]))


def quantized_reason(
    x: Any,
    weight: Any,
    eps: Any,
    scale: Any = None,
    update: Any = None,
    update_weight: Any = None,
    gate: Any = None,
) -> Reason:
    """Why the quantizing form (out as torchao's per-row float8) declines this call, or None when it
    launches the kernel: what declines the plain kernel, a call without a next norm (no out to
    quantize), then the form's own build and self-check (sm_89 and newer)."""
    args = (x, weight, eps, scale, update, update_weight, gate)
    reason = metadata_reason(*args) or tensor_reason(*args)
    if reason is not None:
        return reason
    if weight is None:
        return "the quantizing form needs a next norm"
    config = Config(x.dtype, x.shape[-1], "row")
    return OP.unbuilt(x.device, config) or runtime.runtime_reason(OP, x.device, config)
