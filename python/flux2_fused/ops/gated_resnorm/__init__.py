"""gated_resnorm: `x = residual + gate * update`, then `(1 + scale) * layer_norm(x) + shift`, fused.

The entry points for models are `defer` and `apply`, and they make the site's whole decision: under a
torch.compile trace the site becomes the `torch.ops.flux2_fused` operators of `library` (which decide
when the graph runs); in eager mode the fused kernel runs where the guards prove it exact, else the
eager chain of `reference`, so every caller gets eager's bits by one decision written once. `defer`
leaves `residual + gate * update` pending as a `Segment` that carries its verdict, so the `apply` that
consumes it checks only what the verdict did not cover (the modulation of the norm). `fused` is the
kernel decision without the fallback (None where it declines), and the decline reasons say why a
call is declined. `gated_resnorm` and `modnorm` are the validated ops for direct use: they raise
TypeError / ValueError for what the kernel cannot take instead of falling back.
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
from .launch import KERNEL, launch
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


def defer(
    residual: torch.Tensor, update: torch.Tensor, gate: torch.Tensor, *, enabled: bool = True
) -> Segment | torch.Tensor:
    """`residual + gate * update`, left pending for the next `apply` where that can consume it: a
    `Segment` carrying the verdict (under a torch.compile trace, or where the guard accepts), else
    the eager sum. `enabled=False` (a model's switch) always computes the sum."""
    if enabled and torch.compiler.is_compiling():
        return Segment(residual, update, gate, deferred="traced")
    if enabled and guards.defer(residual, update, gate):
        return Segment(residual, update, gate, deferred="kernel")
    return Segment(residual, update, gate).materialize()


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
        if segment.gated and segment.deferred != "kernel":
            accepted = guards.gated(segment.residual, segment.update, segment.gate, scale, shift)
        else:
            # A segment deferred with the kernel's verdict has its residual, update and gate accepted
            # already: the plain guard adds what the verdict could not see (scale and shift against
            # the residual, the runtime state), and together they are the gated guard.
            accepted = guards.plain(segment.residual, scale, shift)
        if not accepted:
            return None
    if not rows[0].gated:
        out = launch(rows, scale, shift, eps, write_residual=False)[0]
        return out, rows[0].residual if write_residual else None
    return launch(rows, scale, shift, eps, write_residual=write_residual)


def apply(
    rows: Sequence[Segment],
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float,
    *,
    write_residual: bool,
    enabled: bool = True,
) -> Result:
    """(out, stream): the site's one decision. Under a torch.compile trace the `library` operators;
    else `fused` where it accepts, else the eager chain (`reference.segments`), bit for bit the same.
    stream is None where the kernel was told not to write it. `enabled=False` (a model's switch)
    always runs the eager chain."""
    if enabled and torch.compiler.is_compiling():
        return _traced(rows, scale, shift, eps)
    result = fused(rows, scale, shift, eps, write_residual=write_residual) if enabled else None
    return result if result is not None else reference.segments(rows, scale, shift, eps)


def _traced(rows: Sequence[Segment], scale: torch.Tensor, shift: torch.Tensor, eps: float) -> Result:
    """(out, stream) through the operators, which decide when the compiled graph runs: one gated
    segment is the gated operator, anything else its stream (concatenated) through the plain one."""
    from . import library

    if len(rows) == 1 and rows[0].gated:
        segment = rows[0]
        return library.gated_resnorm(segment.residual, segment.update, segment.gate, scale, shift, eps)
    stream = reference.stream(rows)
    return library.modnorm(stream, scale, shift, eps), stream


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
    "KERNEL",
    "MAX_DIM",
    "OP",
    "SUPPORTED_DTYPES",
    "Config",
    "Segment",
    "apply",
    "decline_reason",
    "defer",
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
