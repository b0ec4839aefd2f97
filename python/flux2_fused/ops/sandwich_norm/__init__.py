"""sandwich_norm: Z-Image's sandwich-norm sites with diffusers' `RMSNorm` module, fused.

A Z-Image block wraps attention and the feed-forward in a "sandwich" of diffusers `RMSNorm`s with
weights: `x + gate * norm2(attention(norm1(x) * scale))`, then the same around the feed-forward. The
entry point for models is `apply(x, weight, eps, scale=None, update=None, update_weight=None,
gate=None) -> (out, stream)`: the stream `x + gate * rms(update)` (x itself without an update) and the
next norm's output `rms(stream) * scale` (None without a weight), from one launch where the guards
prove it exact, else from the eager chain of `reference`, bit for bit the same. `fused` is the same
decision without the fallback; `sandwich_norm` is the validated op that raises for inputs the kernel
cannot take. Under a torch.compile trace `apply` runs the eager chain.

`quantized` is the site's quantizing form for torchao float8 Linears that read only the next norm's
out (per row): the kernel writes torchao's float8 of out (its bytes and a scale a row) in place of
out, which is never written; `quantized_reason` says why it declines.
"""

from __future__ import annotations

import torch

from ..verdicts import raise_for
from . import guards, reference
from .guards import SUPPORTED_DTYPES, decline_reason, quantized_reason
from .launch import KERNEL, launch, launch_quantized
from .selfcheck import OP, Config, self_check

Result = tuple[torch.Tensor | None, torch.Tensor]


def fused(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    scale: torch.Tensor | None = None,
    update: torch.Tensor | None = None,
    update_weight: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> Result | None:
    """(out, stream) from one kernel launch, or None where the guards decline."""
    try:
        if decline_reason(x, weight, eps, scale, update, update_weight, gate) is not None:
            return None
    except Exception:  # a guard must never be the reason a generation fails
        return None
    return launch(x, weight, eps, scale, update, update_weight, gate)


def apply(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    scale: torch.Tensor | None = None,
    update: torch.Tensor | None = None,
    update_weight: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    *,
    enabled: bool = True,
) -> Result:
    """The site's one decision: `fused` where it accepts (not under a torch.compile trace, not with
    `enabled=False`), else the eager chain: the same bits."""
    args = (x, weight, eps, scale, update, update_weight, gate)
    if enabled and not torch.compiler.is_compiling():
        out = fused(*args)
        if out is not None:
            return out
    return reference.sandwich(*args)


def quantized(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None = None,
    update: torch.Tensor | None = None,
    update_weight: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q, q_scale, stream): the site's out as torchao's per-row float8 (e4m3fn bytes of out's shape,
    a float32 scale a row [B, S, 1]) and its stream, from one launch; None where the form declines
    (`quantized_reason`) or under a torch.compile trace (the caller then computes out, and the
    Linears quantize it)."""
    if torch.compiler.is_compiling():
        return None
    try:
        if quantized_reason(x, weight, eps, scale, update, update_weight, gate) is not None:
            return None
    except Exception:  # a guard must never be the reason a generation fails
        return None
    return launch_quantized(x, weight, eps, scale, update, update_weight, gate)


def sandwich_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    scale: torch.Tensor | None = None,
    update: torch.Tensor | None = None,
    update_weight: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> Result:
    """The kernel, without the self-check. Unsupported inputs raise TypeError (types, dtypes,
    devices) or ValueError (shapes, layouts, a call without an update or a norm) naming the problem."""
    args = (x, weight, eps, scale, update, update_weight, gate)
    raise_for(guards.metadata_reason(*args) or guards.tensor_reason(*args))
    return launch(*args)


__all__ = [
    "KERNEL",
    "OP",
    "SUPPORTED_DTYPES",
    "Config",
    "apply",
    "decline_reason",
    "fused",
    "guards",
    "quantized",
    "quantized_reason",
    "reference",
    "sandwich_norm",
    "self_check",
]
