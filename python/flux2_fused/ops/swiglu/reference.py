"""The eager SwiGLU the kernel replaces, op for op as diffusers' Flux2SwiGLU (one projection) and
Z-Image's FeedForward (two) write it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(a) * b` for x = [a, b] split in halves on the last dim, or for a = x and b given: two aten
    kernels, each rounding once to x's dtype."""
    if b is not None:
        return F.silu(x) * b
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]
