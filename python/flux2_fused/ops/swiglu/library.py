"""The op as a torch.library operator, so torch.compile keeps the fused SwiGLU as one node.

`torch.ops.flux2_fused.swiglu(x) -> out` is `apply(x)`: the kernel where the guards accept (decided
when the op runs), the eager chain elsewhere. Where a gradient is needed it is the differentiable
eager chain. (The single block's write into half of a wider buffer stays an eager-mode fusion: an
operator that writes into its argument would have to be declared mutating, and the compiled graph
fuses the concatenation itself.)
"""

from __future__ import annotations

import torch

from . import apply, reference

_LIB = torch.library.Library("flux2_fused", "FRAGMENT")
_LIB.define("swiglu(Tensor x) -> Tensor")


def _swiglu(x: torch.Tensor) -> torch.Tensor:
    return apply(x)


def _autograd(x: torch.Tensor) -> torch.Tensor:
    """The eager chain (differentiable) when a gradient is needed, else the implementation below
    autograd. Inference mode never reaches it."""
    if torch.is_grad_enabled() and x.requires_grad:
        return reference.swiglu(x)
    with torch._C._AutoDispatchBelowAutograd():
        return swiglu(x)


swiglu = torch.ops.flux2_fused.swiglu.default
_LIB.impl("swiglu", _swiglu, "CompositeExplicitAutograd")
_LIB.impl("swiglu", _autograd, "Autograd")


@torch.library.register_fake("flux2_fused::swiglu", lib=_LIB)
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
