"""swiglu: `silu(a) * b` for x = [a, b], fused and reading the projection in place, or for a and b two
tensors (`b=`: Z-Image's feed-forward, `silu(w1(x)) * w3(x)`).

The entry point for models is `apply(x, out=None, *, b=None)`: the kernel where the guards prove it
exact, writing into `out` when given (the single block passes the second half of the buffer its
output projection reads, so the eager `cat` disappears), else the eager chain of `reference` (copied
into `out` when given), bit for bit the same. `fused` is the same decision without the fallback;
`swiglu` is the validated op that raises for inputs the kernel cannot take. Under a torch.compile
trace the site is `torch.ops.flux2_fused.swiglu` (`library`), which decides when the graph runs;
`concat` is the single block's `cat([attention, swiglu(mlp)])` with the activation written in place.
The decisions are every row-wise op's (`ops/rowwise.py`, `RowOp`).
"""

from __future__ import annotations

import torch

from ..rowwise import RowOp
from . import guards, reference
from .guards import SUPPORTED_DTYPES, decline_reason
from .launch import KERNEL, launch, launch_joint, launch_quantized
from .selfcheck import OP, Config, self_check


def _operator(x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    from . import library  # it imports this package's `apply`: resolved when first traced

    return library.swiglu(x, b)


_ROWS = RowOp(guards.rows, launch, reference.swiglu, _operator, launch_quantized, launch_joint)


def fused(
    x: torch.Tensor, out: torch.Tensor | None = None, b: torch.Tensor | None = None
) -> torch.Tensor | None:
    """silu(a) * b from one kernel launch (into `out` when given), or None where the guards decline."""
    return _ROWS.fused(x, out, b)


def apply(
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    b: torch.Tensor | None = None,
    enabled: bool = True,
) -> torch.Tensor:
    """The site's one decision: under a torch.compile trace the `library` operator, else `fused`
    where it accepts, else the eager chain; into `out` when given. The same bits every way.
    `enabled=False` (a model's switch) always runs the eager chain."""
    return _ROWS.apply(x, out, b=b, enabled=enabled)


def concat(prefix: torch.Tensor, x: torch.Tensor, *, enabled: bool = True) -> torch.Tensor:
    """`cat([prefix, swiglu(x)], dim=-1)`, as a single block feeds its output projection: in eager
    mode the activation is written straight into its half of the joint buffer, so nothing is
    concatenated afterwards; under a trace or switched off, the eager `cat` (the compiled graph
    keeps it: the operator returns a fresh tensor)."""
    return _ROWS.concat(prefix, x, enabled=enabled)


def quantized(
    x: torch.Tensor,
    *,
    prefix: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    granularity: str = "row",
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The row [prefix | swiglu(x)] (`swiglu(x, b=b)`) as the next float8 Linear's torchao
    quantization of it, (e4m3fn bytes, float32 scales per `granularity`): per row from one launch
    that never writes the activation, per tensor from the joint rows and their amax words; None
    where the guards decline (`RowOp.quantized`)."""
    return _ROWS.quantized(x, prefix=prefix, b=b, granularity=granularity)


def swiglu(x: torch.Tensor, out: torch.Tensor | None = None, b: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel, without the self-check. Unsupported inputs raise TypeError (types, dtypes,
    devices) or ValueError (shapes, strides, alignment, overlap) naming the problem."""
    return _ROWS.validated(x, out, b)


__all__ = [
    "KERNEL",
    "OP",
    "SUPPORTED_DTYPES",
    "Config",
    "apply",
    "concat",
    "decline_reason",
    "fused",
    "guards",
    "quantized",
    "reference",
    "self_check",
    "swiglu",
]
