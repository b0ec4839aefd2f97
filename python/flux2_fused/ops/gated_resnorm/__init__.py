"""gated_resnorm: `x = residual + gate * update`, then `(1 + scale) * layer_norm(x) + shift`, fused.

The one entry point for models and integrations is `apply`: the fused kernel where the guards
prove it exact, else the eager chain of `reference`, so every caller gets eager's bits by one
decision written once. `fused` is the same decision without the fallback (None where it declines),
`can_defer` says whether a gated update may be left pending for a later `apply`, and the decline
reasons say why a call is declined. `gated_resnorm` and `modnorm` are the validated ops for direct
use: they raise TypeError / ValueError for what the kernel cannot take instead of falling back.
Under torch.compile the sites are the `torch.ops.flux2_fused` operators of `library`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import guards, reference
from .guards import (
    MAX_DIM,
    SUPPORTED_DTYPES,
    defer_decline_reason,
    gated_resnorm_decline_reason,
    modnorm_decline_reason,
)
from .launch import launch
from .reference import Segment
from .selfcheck import OP, Config, self_check

Result = tuple[torch.Tensor, torch.Tensor | None]


def _rows_reason(rows: Sequence[Segment], write_residual: bool) -> str | None:
    """What one launch cannot do with these segments, whatever their tensors."""
    if len(rows) not in (1, 2):
        return f"a launch takes one or two segments, got {len(rows)}"
    if len(rows) == 2:
        first, second = rows
        if first.gated != second.gated:
            return "the two segments mix gated and plain rows"
        if not first.gated and write_residual:
            return "the kernel writes no concat of plain rows"
        if first.residual.dim() != 3 or second.residual.dim() != 3:
            return "segments to concatenate must be [B, T, D]"
        if first.residual.shape[0] != second.residual.shape[0]:
            return "the two segments differ in batch"
    return None


def _segment_reason(segment: Segment, scale: torch.Tensor, shift: torch.Tensor) -> str | None:
    if segment.gated:
        return gated_resnorm_decline_reason(segment.residual, segment.update, segment.gate, scale, shift)
    return modnorm_decline_reason(segment.residual, scale, shift)


def can_defer(residual: torch.Tensor, update: torch.Tensor, gate: torch.Tensor) -> bool:
    """True when `residual + gate * update` may be left pending for a later fused `apply`: the
    kernel would take it as a gated segment. Never raises."""
    return guards.defer(residual, update, gate)


def decline_reason(
    rows: Sequence[Segment], scale: torch.Tensor, shift: torch.Tensor, *, write_residual: bool = True
) -> str | None:
    """Why `fused(rows, ...)` declines, or None when it launches the kernel."""
    reason = _rows_reason(rows, write_residual)
    for segment in rows:
        reason = reason or _segment_reason(segment, scale, shift)
    return reason


def fused(
    rows: Sequence[Segment], scale: torch.Tensor, shift: torch.Tensor, eps: float, *, write_residual: bool
) -> Result | None:
    """(out, stream) from one kernel launch, or None where the guards decline.

    rows: one segment, or two whose rows are concatenated along tokens. stream is the site's rows as
    one tensor when write_residual (a single plain segment: its residual itself), else None.
    """
    try:
        if _rows_reason(rows, write_residual) is not None:
            return None
    except Exception:  # not segments of tensors: declined, as the guards decline garbage
        return None
    for segment in rows:
        if segment.gated:
            accepted = guards.gated(segment.residual, segment.update, segment.gate, scale, shift)
        else:
            accepted = guards.plain(segment.residual, scale, shift)
        if not accepted:
            return None
    if not rows[0].gated:
        out = launch(rows, scale, shift, eps, write_residual=False)[0]
        return out, rows[0].residual if write_residual else None
    return launch(rows, scale, shift, eps, write_residual=write_residual)


def apply(
    rows: Sequence[Segment], scale: torch.Tensor, shift: torch.Tensor, eps: float, *, write_residual: bool
) -> Result:
    """(out, stream): `fused` where it accepts, else the eager chain (`reference.segments`), bit for bit
    the same. stream is None where the kernel was told not to write it."""
    result = fused(rows, scale, shift, eps, write_residual=write_residual)
    return result if result is not None else reference.segments(rows, scale, shift, eps)


def gated_resnorm(
    residual: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on one gated site, without the self-check: fresh (out, residual_out).

    Inputs are never modified. Unsupported inputs raise TypeError (types, dtypes, devices) or
    ValueError (shapes, strides, alignment, sizes) naming the problem.
    """
    guards.gated.validate(residual, update, gate, scale, shift)
    out, residual_out = launch([Segment(residual, update, gate)], scale, shift, eps, write_residual=True)
    assert residual_out is not None
    return out, residual_out


def modnorm(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The kernel's no-residual variant `(1 + scale) * layer_norm(x) + shift`, without the self-check;
    raises like `gated_resnorm`."""
    guards.plain.validate(x, scale, shift)
    return launch([Segment(x)], scale, shift, eps, write_residual=False)[0]


gated_resnorm_reference = reference.gated_resnorm
modnorm_reference = reference.modnorm

__all__ = [
    "MAX_DIM",
    "OP",
    "SUPPORTED_DTYPES",
    "Config",
    "Segment",
    "apply",
    "can_defer",
    "decline_reason",
    "defer_decline_reason",
    "fused",
    "gated_resnorm",
    "gated_resnorm_decline_reason",
    "gated_resnorm_reference",
    "guards",
    "modnorm",
    "modnorm_decline_reason",
    "modnorm_reference",
    "reference",
    "self_check",
]
