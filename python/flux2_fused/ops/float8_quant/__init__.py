"""float8_quant: torchao's dynamic float8 quantization of an activation, in one kernel.

torchao's `Float8DynamicActivationFloat8WeightConfig` (its torch path, PerRow or PerTensor, e4m3fn)
quantizes every quantized Linear's input on the fly: `abs`, `amax`, the division by 448, the cast of
the scale, the division of x by it, the clamp and the cast to float8 are six kernels, run again for
each Linear that reads the same activation. The entry point for models is `apply(x, granularity)`
-> (q, scale): one launch (two for a tensor's scale) where the guards prove it exact, else the eager
chain of `reference`, torchao's bits either way. `fused` is the same decision without the fallback;
`float8_quant` is the validated op that raises for inputs the kernel cannot take. Under a
torch.compile trace `apply` runs the eager chain.
"""

from __future__ import annotations

import torch

from ..verdicts import raise_for
from . import guards, reference
from .guards import SUPPORTED_DTYPES, decline_reason
from .launch import KERNEL, launch
from .selfcheck import OP, Config, self_check

Result = tuple[torch.Tensor, torch.Tensor]


def fused(x: torch.Tensor, granularity: str = "row", words: torch.Tensor | None = None) -> Result | None:
    """(q, scale) from the kernel, or None where the guards decline. `words` (per tensor): x's amax
    words as the kernel that wrote x left them (a row-wise op's joint form), which skip the launch
    that would reduce them."""
    if not guards.accepts(x, granularity, words):
        return None
    return launch(x, granularity, words)


def apply(
    x: torch.Tensor, granularity: str = "row", *, words: torch.Tensor | None = None, enabled: bool = True
) -> Result:
    """The site's one decision: `fused` where it accepts (not under a torch.compile trace, not with
    `enabled=False`), else the eager chain: the same bits."""
    if enabled and not torch.compiler.is_compiling():
        out = fused(x, granularity, words)
        if out is not None:
            return out
    return reference.quantize(x, granularity)


def float8_quant(x: torch.Tensor, granularity: str = "row", words: torch.Tensor | None = None) -> Result:
    """The kernel, without the self-check. Unsupported inputs raise TypeError (types, dtypes,
    devices) or ValueError (shapes, layouts, granularity, words) naming the problem."""
    raise_for(guards.metadata_reason(x, granularity, words) or guards.call_reason(["x"], [x], guards.ALIGN))
    return launch(x, granularity, words)


__all__ = [
    "KERNEL",
    "OP",
    "SUPPORTED_DTYPES",
    "Config",
    "apply",
    "decline_reason",
    "float8_quant",
    "fused",
    "guards",
    "reference",
    "self_check",
]
