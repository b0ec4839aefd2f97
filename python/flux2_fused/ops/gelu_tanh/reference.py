"""The eager GELU (tanh approximation) the kernel replaces, as FLUX.1's blocks run it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """`F.gelu(x, approximate="tanh")`: one aten kernel (fp32 math, one rounding to x's dtype), what
    diffusers' `GELU(approximate="tanh")` (FLUX.1's double-block feed-forward, after its projection)
    and `nn.GELU(approximate="tanh")` (the single block's `act_mlp`) run."""
    return F.gelu(x, approximate="tanh")
