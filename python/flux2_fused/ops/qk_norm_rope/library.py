"""The op as a torch.library operator, so torch.compile keeps the fused prologue as one node.

`torch.ops.flux2_fused.qk_norm_rope(q, q_weight, k, k_weight, v, cos, sin, eps, upcast=False,
rotation="aten", norm="fused") ->
[q, k(, v)]` is `apply` over one or two segments: q and k are lists of segment rows with their lists
of RMSNorm weights, v the list of v's segments, empty where attention reads v as it is (the single
block), and then only q and k come back; `upcast` is FLUX.3's mode (float32 weights, norm and RoPE in
fp32, one rounding), `rotation` the host's RoPE arithmetic, `norm` its q/k norm. The kernel runs where
the guards accept (decided when the op runs), the eager chain elsewhere; where a gradient is needed it
is the differentiable eager chain.
"""

from __future__ import annotations

import torch

from . import apply, reference
from .reference import Segment

_LIB = torch.library.Library("flux2_fused", "FRAGMENT")
_LIB.define(
    "qk_norm_rope(Tensor[] q, Tensor[] q_weight, Tensor[] k, Tensor[] k_weight, Tensor[] v, Tensor cos,"
    " Tensor sin, float eps, bool upcast=False, str rotation='aten', str norm='fused') -> Tensor[]"
)


def _segments(xs: list[torch.Tensor], weights: list[torch.Tensor]) -> list[Segment]:
    return [Segment(x, w) for x, w in zip(xs, weights, strict=True)]


def _outputs(result: tuple) -> list[torch.Tensor]:
    return [t for t in result if t is not None]


def _qk_norm_rope(q, q_weight, k, k_weight, v, cos, sin, eps, upcast=False, rotation="aten", norm="fused"):
    rows = (_segments(q, q_weight), _segments(k, k_weight))
    return _outputs(apply(*rows, cos, sin, eps, v or None, upcast=upcast, rotation=rotation, norm=norm))


def _autograd(q, q_weight, k, k_weight, v, cos, sin, eps, upcast=False, rotation="aten", norm="fused"):
    """The eager chain (differentiable) when a gradient is needed, else the implementation below
    autograd. Inference mode never reaches it."""
    tensors = (*q, *q_weight, *k, *k_weight, *v, cos, sin)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        rows = (_segments(q, q_weight), _segments(k, k_weight))
        mode = {"upcast": upcast, "rotation": rotation, "norm": norm}
        return _outputs(reference.prologue(*rows, cos, sin, eps, v or None, **mode))
    with torch._C._AutoDispatchBelowAutograd():
        return qk_norm_rope(q, q_weight, k, k_weight, v, cos, sin, eps, upcast, rotation, norm)


qk_norm_rope = torch.ops.flux2_fused.qk_norm_rope.default
_LIB.impl("qk_norm_rope", _qk_norm_rope, "CompositeExplicitAutograd")
_LIB.impl("qk_norm_rope", _autograd, "Autograd")


@torch.library.register_fake("flux2_fused::qk_norm_rope", lib=_LIB)
def _(q, q_weight, k, k_weight, v, cos, sin, eps, upcast=False, rotation="aten", norm="fused"):
    first = q[0]
    shape = (first.shape[0], sum(x.shape[1] for x in q), *first.shape[2:])
    return [first.new_empty(shape) for _ in range(3 if v else 2)]
