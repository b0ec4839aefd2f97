"""qk_norm_rope: the attention prologue, per-head RMSNorm with weight then RoPE, fused.

The entry point for models is `apply(rows, cos, sin, eps)`: the joint rotated q (or k) [B, S, H, 128]
from the kernel where the guards prove it exact, else from the eager chain of `reference`, bit for
bit the same. `rows` is one segment (a single block's joint rows) or two (a double block's text then
image rows, each with its own RMSNorm weight): the kernel writes both into the joint buffer, so the
eager `cat` disappears. `fused` is the same decision without the fallback; `qk_norm_rope` is the
validated op that raises for inputs the kernel cannot take. Under torch.compile the sites are
`torch.ops.flux2_fused.qk_norm_rope` (`library`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import guards, reference
from .guards import SUPPORTED_DTYPES, segment_decline_reason
from .launch import launch
from .reference import Segment
from .selfcheck import HEAD_DIM, OP, Config, self_check


def _rows_reason(rows: Sequence[Segment], cos: torch.Tensor) -> str | None:
    """What one launch cannot do with these segments, whatever each segment's own layout."""
    if len(rows) not in (1, 2):
        return f"a launch takes one or two segments, got {len(rows)}"
    first = rows[0].x
    for segment in rows[1:]:
        if segment.x.dim() != 4 or first.dim() != 4 or segment.x.shape[::2] != first.shape[::2]:
            return "the segments differ in batch or heads"
    tokens = sum(segment.x.shape[1] for segment in rows)
    if cos.dim() != 2 or cos.shape[0] != tokens:
        return f"the RoPE tables have {cos.shape[0] if cos.dim() else 0} rows, the segments {tokens} tokens"
    return None


def decline_reason(rows: Sequence[Segment], cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why `fused(rows, cos, sin, eps)` declines, or None when it launches the kernel."""
    reason = None
    for segment in rows:
        reason = reason or segment_decline_reason(segment.x, segment.weight, cos, sin)
    return reason or _rows_reason(rows, cos)


def fused(rows: Sequence[Segment], cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor | None:
    """The joint rotated rows from one kernel launch, or None where the guards decline."""
    if not isinstance(eps, float | int):  # eps=None means aten's own default, not ours to guess
        return None
    for segment in rows:
        if not guards.segment(segment.x, segment.weight, cos, sin):
            return None
    try:
        if _rows_reason(rows, cos) is not None:
            return None
    except Exception:  # not segments of tensors: declined, as the guards decline garbage
        return None
    return launch(rows, cos, sin, eps)


def apply(rows: Sequence[Segment], cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """`fused` where it accepts, else the eager chain (`reference.qk_norm_rope`): the same bits."""
    out = fused(rows, cos, sin, eps)
    return out if out is not None else reference.qk_norm_rope(rows, cos, sin, eps)


def qk_norm_rope(
    rows: Sequence[Segment], cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """The kernel, without the self-check: the joint rotated rows [B, sum S, H, 128].

    Unsupported inputs raise TypeError (types, dtypes, devices) or ValueError (shapes, strides,
    alignment) naming the problem.
    """
    for segment in rows:
        guards.segment.validate(segment.x, segment.weight, cos, sin)
    reason = _rows_reason(rows, cos)
    if reason is not None:
        raise ValueError(f"flux2-fused: {reason}")
    return launch(rows, cos, sin, eps)


__all__ = [
    "HEAD_DIM",
    "OP",
    "SUPPORTED_DTYPES",
    "Config",
    "Segment",
    "apply",
    "decline_reason",
    "fused",
    "guards",
    "qk_norm_rope",
    "reference",
    "segment_decline_reason",
    "self_check",
]
