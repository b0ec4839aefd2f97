"""The eager chain the sandwich-norm kernel replaces, op for op as Z-Image's block writes it with
diffusers' `RMSNorm` module: the gated update of the stream by the norm of a block output, then the
norm of the new stream, times the next modulation's scale. docs/numerics.md (14) gives the arithmetic.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """diffusers' `RMSNorm(D, eps)` with a weight of x's dtype: the fp32 variance by pow and mean,
    `x * rsqrt(variance + eps)` rounded to the weight's dtype, times the weight."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + eps)).to(weight.dtype) * weight


def sandwich(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    scale: torch.Tensor | None = None,
    update: torch.Tensor | None = None,
    update_weight: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(out, stream): stream = x + gate * rms(update; update_weight) (x itself without an update, the
    product without a gate), out = rms(stream; weight) * scale (None without a weight, the norm alone
    without a scale)."""
    stream = x
    if update is not None:
        normed = rms_norm(update, update_weight, eps)
        stream = x + (normed if gate is None else gate * normed)
    if weight is None:
        return None, stream
    out = rms_norm(stream, weight, eps)
    return (out if scale is None else out * scale), stream
