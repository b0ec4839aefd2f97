"""swiglu: `silu(a) * b` for x = [a, b], fused and reading the projection in place.

The entry point for models is `apply(x, out=None)`: the kernel where the guards prove it exact,
writing into `out` when given (the single block passes the second half of the buffer its output
projection reads, so the eager `cat` disappears), else the eager chain of `reference` (copied into
`out` when given), bit for bit the same. `fused` is the same decision without the fallback;
`swiglu` is the validated op that raises for inputs the kernel cannot take. Under torch.compile the
site is `torch.ops.flux2_fused.swiglu` (`library`).
"""

from __future__ import annotations

import torch

from . import guards, reference
from .guards import SUPPORTED_DTYPES, decline_reason
from .launch import launch
from .selfcheck import OP, Config, self_check


def fused(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """silu(a) * b from one kernel launch (into `out` when given), or None where the guards decline."""
    if out is None:
        accepted = guards.plain(x)
    else:
        try:
            accepted = guards.into(x, out) and guards.overlap_reason(x, out) is None
        except Exception:  # not tensors: declined, as the guards decline garbage
            accepted = False
    return launch(x, out) if accepted else None


def apply(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`fused` where it accepts, else the eager chain (copied into `out` when given): the same bits."""
    result = fused(x, out)
    if result is not None:
        return result
    eager = reference.swiglu(x)
    return eager if out is None else out.copy_(eager)


def swiglu(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel, without the self-check. Unsupported inputs raise TypeError (types, dtypes,
    devices) or ValueError (shapes, strides, alignment, overlap) naming the problem."""
    if out is None:
        guards.plain.validate(x)
    else:
        guards.into.validate(x, out)
        reason = guards.overlap_reason(x, out)
        if reason is not None:
            raise ValueError(f"flux2-fused: {reason}")
    return launch(x, out)


__all__ = [
    "OP",
    "SUPPORTED_DTYPES",
    "Config",
    "apply",
    "decline_reason",
    "fused",
    "guards",
    "reference",
    "self_check",
    "swiglu",
]
