"""The eager attention prologue the kernel replaces: RMSNorm of each head, then RoPE, op for op as
diffusers' FLUX.2 attention processors write it.

A double block normalizes text and image rows with their own weights (`norm_added_q` / `norm_q`),
concatenates them text first, and rotates the joint rows; a single block normalizes and rotates its
joint rows at once. RoPE is elementwise per (token, channel), so the rotation of a concat is the
concat of the rotations: the kernel writes both segments' rows straight into the joint buffer.
docs/numerics.md gives the arithmetic.
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
    rows: Sequence[Segment], cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """The joint rotated rows [B, sum S, H, hd]: each segment normalized with its weight,
    concatenated along tokens in order, then rotated."""
    normed = [rms_norm(segment.x, segment.weight, eps) for segment in rows]
    joint = normed[0] if len(normed) == 1 else torch.cat(normed, dim=1)
    return rope(joint, cos, sin)
