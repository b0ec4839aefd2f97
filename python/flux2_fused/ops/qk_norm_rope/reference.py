"""The eager attention prologue the kernel replaces: RMSNorm of each head of q and k, then RoPE, op
for op as diffusers' FLUX.2 attention processors write it, and a double block's concat of v; with
`upcast=True`, as diffusers' `Flux3AttnProcessor` writes it (FLUX.3).

A double block normalizes text and image rows with their own weights (`norm_added_q` / `norm_q`),
concatenates them text first, and rotates the joint rows; v's text and image rows are concatenated
alike. A single block normalizes and rotates its joint rows at once, and attention reads its v as it
is. RoPE is elementwise per (token, channel), so the rotation of a concat is the concat of the
rotations: the kernel writes both segments' rows straight into the joint buffers.

FLUX.3 upcasts: `norm_q(query.float())` (an `nn.RMSNorm` whose weight stays float32), RoPE on that
fp32 result (`x.float()` and `.to(x.dtype)` are then no-ops), and one `.to(dtype)` at the end, so the
norm's output is never rounded to the 16-bit dtype. docs/numerics.md gives the arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows of one projection: x [B, S, H, head_dim] (a view of the Linear's output) and the RMSNorm
    weight [head_dim] that normalizes them."""

    x: torch.Tensor
    weight: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`torch.nn.RMSNorm(head_dim, eps)` with this weight, over the last dim."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs (GPT-J style) of x [B, S, H, hd] by the fp32 tables [S, hd]:
    `x * cos + rotated * sin` in fp32, rounded once to x's dtype."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def qk_norm_rope(
    rows: Sequence[Segment], cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6, *, upcast: bool = False
) -> torch.Tensor:
    """The joint rotated rows [B, sum S, H, hd]: each segment normalized with its weight,
    concatenated along tokens in order, then rotated. `upcast`: each segment widened to fp32 before
    its norm, norm and RoPE in fp32, the result rounded once to the rows' dtype (FLUX.3)."""
    normed = [rms_norm(segment.x.float() if upcast else segment.x, segment.weight, eps) for segment in rows]
    joint = normed[0] if len(normed) == 1 else torch.cat(normed, dim=1)
    out = rope(joint, cos, sin)
    return out.to(rows[0].x.dtype) if upcast else out


def prologue(
    q: Sequence[Segment],
    k: Sequence[Segment],
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-6,
    v: Sequence[torch.Tensor] | None = None,
    *,
    upcast: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q, k, v) for attention: q's and k's joint rotated rows, and v's segments concatenated along
    tokens (None when v is not given: the single block's v needs no copy). `upcast`: FLUX.3's
    prologue (see `qk_norm_rope`)."""
    value = None if v is None else torch.cat(list(v), dim=1)
    return qk_norm_rope(q, cos, sin, eps, upcast=upcast), qk_norm_rope(k, cos, sin, eps, upcast=upcast), value
