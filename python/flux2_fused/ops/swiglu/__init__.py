"""swiglu: `silu(a) * b` for x = [a, b], fused and reading the projection in place.

The entry point for models is `apply(x, out=None)`: the kernel where the guards prove it exact,
writing into `out` when given (the single block passes the second half of the buffer its output
projection reads, so the eager `cat` disappears), else the eager chain of `reference` (copied into
`out` when given), bit for bit the same. `fused` is the same decision without the fallback;
`swiglu` is the validated op that raises for inputs the kernel cannot take. Under a torch.compile
trace the site is `torch.ops.flux2_fused.swiglu` (`library`), which decides when the graph runs;
`concat` is the single block's `cat([attention, swiglu(mlp)])` with the activation written in place.
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


def apply(x: torch.Tensor, out: torch.Tensor | None = None, *, enabled: bool = True) -> torch.Tensor:
    """The site's one decision: under a torch.compile trace the `library` operator, else `fused`
    where it accepts, else the eager chain; into `out` when given. The same bits every way.
    `enabled=False` (a model's switch) always runs the eager chain."""
    if enabled and torch.compiler.is_compiling():
        from . import library

        result = library.swiglu(x)
        return result if out is None else out.copy_(result)
    result = fused(x, out) if enabled else None
    if result is not None:
        return result
    eager = reference.swiglu(x)
    return eager if out is None else out.copy_(eager)


def concat(prefix: torch.Tensor, x: torch.Tensor, *, enabled: bool = True) -> torch.Tensor:
    """`cat([prefix, swiglu(x)], dim=-1)`, as a single block feeds its output projection: in eager
    mode the activation is written straight into its half of the joint buffer, so nothing is
    concatenated afterwards; under a trace or switched off, the eager `cat` (the compiled graph
    keeps it: the operator returns a fresh tensor)."""
    if not enabled or torch.compiler.is_compiling():
        return torch.cat([prefix, apply(x, enabled=enabled)], dim=-1)
    width = prefix.shape[-1]
    joint = prefix.new_empty((*prefix.shape[:-1], width + x.shape[-1] // 2))
    joint[..., :width].copy_(prefix)
    apply(x, out=joint[..., width:])
    return joint


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
    "concat",
    "decline_reason",
    "fused",
    "guards",
    "reference",
    "self_check",
    "swiglu",
]
