"""What the uniform-rows check answers, in torch: whether any row of a [B, S, W] (or [S, W]) tensor
differs from its batch's first row in any bit. The kernel's word is this predicate (1 differs, 0 all
equal); comparing bit patterns, not values, makes -0.0 differ from +0.0 and a NaN equal only to the
same NaN, which is what reading one row in place of another must respect."""

from __future__ import annotations

import torch

from ..bits import as_bits


def differs(x: torch.Tensor) -> torch.Tensor:
    """One int32 word on x's device: 1 where a row of x differs from its batch's first, else 0."""
    bits = as_bits(x)
    rows = bits if bits.dim() == 3 else bits.unsqueeze(0)
    return (rows != rows[:, :1]).any().to(torch.int32).reshape(1)
