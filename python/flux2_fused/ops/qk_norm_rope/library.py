"""The op as a torch.library operator, so torch.compile keeps the fused prologue as one node.

`torch.ops.flux2_fused.qk_norm_rope(x, weight, x2, weight2, cos, sin, eps) -> out` is `apply` over
one segment (x2 and weight2 None) or two: the kernel where the guards accept (decided when the op
runs), the eager chain elsewhere. Where a gradient is needed it is the differentiable eager chain.
"""

from __future__ import annotations

import torch

from . import apply, reference
from .reference import Segment

_LIB = torch.library.Library("flux2_fused", "FRAGMENT")
_LIB.define(
    "qk_norm_rope(Tensor x, Tensor weight, Tensor? x2, Tensor? weight2, Tensor cos, Tensor sin, float eps)"
    " -> Tensor"
)


def _rows(x: torch.Tensor, weight: torch.Tensor, x2: torch.Tensor | None, weight2: torch.Tensor | None):
    return [Segment(x, weight)] + ([Segment(x2, weight2)] if x2 is not None else [])


def _qk_norm_rope(x, weight, x2, weight2, cos, sin, eps):
    return apply(_rows(x, weight, x2, weight2), cos, sin, eps)


def _autograd(x, weight, x2, weight2, cos, sin, eps):
    """The eager chain (differentiable) when a gradient is needed, else the implementation below
    autograd. Inference mode never reaches it."""
    tensors = (x, weight, x2, weight2, cos, sin)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return reference.qk_norm_rope(_rows(x, weight, x2, weight2), cos, sin, eps)
    with torch._C._AutoDispatchBelowAutograd():
        return qk_norm_rope(x, weight, x2, weight2, cos, sin, eps)


qk_norm_rope = torch.ops.flux2_fused.qk_norm_rope.default
_LIB.impl("qk_norm_rope", _qk_norm_rope, "CompositeExplicitAutograd")
_LIB.impl("qk_norm_rope", _autograd, "Autograd")


@torch.library.register_fake("flux2_fused::qk_norm_rope", lib=_LIB)
def _(x, weight, x2, weight2, cos, sin, eps):
    tokens = x.shape[1] + (x2.shape[1] if x2 is not None else 0)
    return x.new_empty((x.shape[0], tokens, *x.shape[2:]))
