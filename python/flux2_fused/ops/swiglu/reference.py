"""The eager SwiGLU the kernel replaces, op for op as diffusers' Flux2SwiGLU writes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """`silu(a) * b` for x = [a, b] split in halves on the last dim: two aten kernels, each rounding
    once to x's dtype."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]
