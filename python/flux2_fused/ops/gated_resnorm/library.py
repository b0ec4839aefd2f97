"""The op as torch.library operators, so torch.compile keeps the fused sites instead of breaking the graph.

`torch.ops.flux2_fused.gated_resnorm(residual, update, gate, scale, shift, eps, update2=None,
addcmul=False) -> (out, residual_out)` and `torch.ops.flux2_fused.modnorm(x, scale, shift, eps,
addcmul=False) -> out` are `apply` (addcmul: ComfyUI's modulation, one rounding): the fused kernel
where the guards accept (checked when the op runs, not when it is traced), the eager chain everywhere
else. update2 is FLUX.3's second update (`residual + gate * (update +
update2)`); modulation rows may be per token. A site `apply` cannot express as one call of these
(per-segment modulation) becomes one call per segment and a concat (`_traced`). Their fake
implementations give Inductor the output shapes, so a compiled model plans around them; Inductor's
own fusion of this chain keeps fp32 intermediates and is not bit-exact, ours is.

Why `torch.library.Library` and not `torch.library.custom_op`: an Inductor graph calls these ops on
the host between its own kernel launches, and early in a step the GPU waits for that host work;
custom_op's Python wrapper (output-aliasing checks and more) costs more host time a call (the
tables in docs/measurements.md). The Autograd kernel keeps what a gradient needs: then the op is the
differentiable eager chain; otherwise it redispatches to the implementation below autograd, so
traced graphs keep the op as one node. Eager-mode callers use `apply` directly and skip the
dispatcher altogether.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import apply, reference
from .reference import Segment

_LIB = torch.library.Library("flux2_fused", "FRAGMENT")
_LIB.define(
    "gated_resnorm(Tensor residual, Tensor update, Tensor gate, Tensor scale, Tensor shift, float eps,"
    " Tensor? update2=None, bool addcmul=False) -> (Tensor, Tensor)"
)
_LIB.define("modnorm(Tensor x, Tensor scale, Tensor shift, float eps, bool addcmul=False) -> Tensor")


def _gated_resnorm(
    residual: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float,
    update2: torch.Tensor | None = None,
    addcmul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    segment = Segment(residual, update, gate, update2=update2)
    out, residual_out = apply([segment], scale, shift, eps, write_residual=True, addcmul=addcmul)
    assert residual_out is not None
    return out, residual_out


def _modnorm(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float, addcmul: bool = False
) -> torch.Tensor:
    return apply([Segment(x)], scale, shift, eps, write_residual=False, addcmul=addcmul)[0]


def _autograd_kernel(op: Callable, eager: Callable) -> Callable:
    """The op's Autograd-key kernel: the eager chain (differentiable) when a gradient is needed,
    else below autograd to the implementation. Inference mode never reaches it."""

    def kernel(*args: object) -> object:
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return eager(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    return kernel


gated_resnorm = torch.ops.flux2_fused.gated_resnorm.default
modnorm = torch.ops.flux2_fused.modnorm.default
_LIB.impl("gated_resnorm", _gated_resnorm, "CompositeExplicitAutograd")
_LIB.impl("modnorm", _modnorm, "CompositeExplicitAutograd")
_LIB.impl("gated_resnorm", _autograd_kernel(gated_resnorm, reference.gated_resnorm), "Autograd")
_LIB.impl("modnorm", _autograd_kernel(modnorm, reference.modnorm), "Autograd")


@torch.library.register_fake("flux2_fused::gated_resnorm", lib=_LIB)
def _(residual, update, gate, scale, shift, eps, update2=None, addcmul=False):
    updates = (update.shape,) if update2 is None else (update.shape, update2.shape)
    residual_shape = torch.broadcast_shapes(residual.shape, gate.shape, *updates)
    out_shape = torch.broadcast_shapes(residual_shape, scale.shape, shift.shape)
    return residual.new_empty(out_shape), residual.new_empty(residual_shape)


@torch.library.register_fake("flux2_fused::modnorm", lib=_LIB)
def _(x, scale, shift, eps, addcmul=False):
    return x.new_empty(torch.broadcast_shapes(x.shape, scale.shape, shift.shape))
