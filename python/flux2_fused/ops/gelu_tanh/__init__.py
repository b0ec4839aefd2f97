"""gelu_tanh: `gelu(x, approximate="tanh")`, fused and able to write into half of a wider buffer.

FLUX.1 runs it in every block: after the double block's feed-forward projections (diffusers'
`GELU(approximate="tanh")`), and in the single block on its MLP projection, whose activation is then
concatenated after the attention output (`cat([attn_output, act_mlp(proj_mlp(h))], dim=2)`) for
`proj_out`. The entry point for models is `apply(x, out=None)`: the kernel where the guards prove it
exact, writing into `out` when given, else the eager op of `reference` (copied into `out` when
given), bit for bit the same. `fused` is the same decision without the fallback; `gelu_tanh` is the
validated op that raises for inputs the kernel cannot take. Under a torch.compile trace the site is
`torch.ops.flux2_fused.gelu_tanh` (`library`), which decides when the graph runs; `concat` is the
single block's `cat` with the activation written in place. The decisions are every row-wise op's
(`ops/rowwise.py`, `RowOp`).
"""

from __future__ import annotations

import torch

from ..rowwise import RowOp
from . import guards, reference
from .guards import SUPPORTED_DTYPES, decline_reason
from .launch import KERNEL, launch, launch_joint, launch_quantized
from .selfcheck import OP, Config, self_check


def _operator(x: torch.Tensor) -> torch.Tensor:
    from . import library  # it imports this package's `apply`: resolved when first traced

    return library.gelu_tanh(x)


_ROWS = RowOp(guards.rows, launch, reference.gelu_tanh, _operator, launch_quantized, launch_joint)


def fused(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """gelu(x, approximate="tanh") from one kernel launch, into `out` when given (a view of x's shape
    over other rows), or None where the guards decline."""
    return _ROWS.fused(x, out)


def apply(x: torch.Tensor, out: torch.Tensor | None = None, *, enabled: bool = True) -> torch.Tensor:
    """The site's one decision: the `library` operator under a torch.compile trace, else `fused`
    where it accepts, else `F.gelu(x, approximate="tanh")`; into `out` when given. The same bits
    every way. `enabled=False` (the model's switch) always runs the eager op; FLUX.1's feed-forward
    calls it on its projection."""
    return _ROWS.apply(x, out, enabled=enabled)


def concat(prefix: torch.Tensor, x: torch.Tensor, *, enabled: bool = True) -> torch.Tensor:
    """FLUX.1's single block: `cat([attn_output, gelu_tanh(mlp)], dim=-1)`, the input of `proj_out`.
    In eager mode the activation goes straight into the second half of the joint buffer and no `cat`
    runs. Under a trace or switched off, the eager `cat`: the compiled graph keeps it, since the
    operator returns a fresh tensor and Inductor fuses the concatenation itself."""
    return _ROWS.concat(prefix, x, enabled=enabled)


def quantized(
    x: torch.Tensor, *, prefix: torch.Tensor | None = None, granularity: str = "row"
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The row [prefix | gelu_tanh(x)] as the next float8 Linear's torchao quantization of it, (e4m3fn
    bytes, float32 scales per `granularity`): per row from one launch that never writes the
    activation, per tensor from the joint rows and their amax words; None where the guards decline
    (`RowOp.quantized`)."""
    return _ROWS.quantized(x, prefix=prefix, granularity=granularity)


def gelu_tanh(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The GELU kernel alone: no self-check, no fallback. Inputs it cannot take raise TypeError
    (not a tensor, dtype, device) or ValueError (shape, strides, alignment, autograd, out overlapping
    x), each naming the problem; `decline_reason` gives the same words without raising."""
    return _ROWS.validated(x, out)


__all__ = [
    "KERNEL",
    "OP",
    "SUPPORTED_DTYPES",
    "Config",
    "apply",
    "concat",
    "decline_reason",
    "fused",
    "gelu_tanh",
    "guards",
    "quantized",
    "reference",
    "self_check",
]
