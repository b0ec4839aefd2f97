"""The fused ops as torch.library operators, so torch.compile keeps them instead of breaking the graph.

`torch.ops.flux2_fused.gated_resnorm(residual, update, gate, scale, shift, eps) -> (out, residual_out)`
and `torch.ops.flux2_fused.modnorm(x, scale, shift, eps) -> out` always return exactly what the eager
chain returns: the fused kernel where the guards accept (checked when the op runs, not when it is
traced), the eager ops everywhere else (CPU, other dtypes, a failed self-check). Their fake
implementations give Inductor the output shapes, so a compiled model plans around them; Inductor's
own fusion of this chain keeps fp32 intermediates and is not bit-exact, ours is.

Why `torch.library.Library` and not `torch.library.custom_op`: an Inductor graph calls these ops on
the host between its own kernel launches, and early in a step the GPU waits for that host work.
custom_op's Python wrapper (output-aliasing checks and more) made a call cost 46 us on the H200's
host, this registration 35 us in the same run (guard, two allocations and the launch included; 24 us
since the guards remember metadata verdicts). The Autograd kernel
keeps what a gradient needs: then the op is the differentiable eager chain; otherwise it redispatches
to the implementation below autograd, so traced graphs keep the op as one node.

The model's eager path calls `gated_resnorm.launch` directly: even this dispatch costs a few
microseconds a call on the host, which eager mode need not pay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import gated_resnorm as ops

_LIB = torch.library.Library("flux2_fused", "DEF")
_LIB.define(
    "gated_resnorm(Tensor residual, Tensor update, Tensor gate, Tensor scale, Tensor shift, float eps)"
    " -> (Tensor, Tensor)"
)
_LIB.define("modnorm(Tensor x, Tensor scale, Tensor shift, float eps) -> Tensor")


def _gated_resnorm(
    residual: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual + gate * update` and `(1 + scale) * layer_norm(that) + shift`, bit-exact to eager."""
    if ops.can_use_flux2_gated_resnorm(residual, update, gate, scale, shift):
        return ops.gated_resnorm_unchecked(residual, update, gate, scale, shift, eps)
    return ops.gated_resnorm_reference(residual, update, gate, scale, shift, eps)


def _modnorm(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    """`(1 + scale) * layer_norm(x) + shift`, bit-exact to eager."""
    if ops.can_use_flux2_modnorm(x, scale, shift):
        return ops.modnorm_unchecked(x, scale, shift, eps)
    return ops.modnorm_reference(x, scale, shift, eps)


def _autograd_kernel(op: Callable, reference: Callable) -> Callable:
    """The op's Autograd-key kernel: the eager chain (differentiable) when a gradient is needed,
    else below autograd to the implementation. Inference mode never reaches it."""

    def kernel(*args: object) -> object:
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return reference(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    return kernel


gated_resnorm = torch.ops.flux2_fused.gated_resnorm.default
modnorm = torch.ops.flux2_fused.modnorm.default
_LIB.impl("gated_resnorm", _gated_resnorm, "CompositeExplicitAutograd")
_LIB.impl("modnorm", _modnorm, "CompositeExplicitAutograd")
_LIB.impl("gated_resnorm", _autograd_kernel(gated_resnorm, ops.gated_resnorm_reference), "Autograd")
_LIB.impl("modnorm", _autograd_kernel(modnorm, ops.modnorm_reference), "Autograd")


@torch.library.register_fake("flux2_fused::gated_resnorm", lib=_LIB)
def _(residual, update, gate, scale, shift, eps):
    residual_shape = torch.broadcast_shapes(residual.shape, gate.shape, update.shape)
    out_shape = torch.broadcast_shapes(residual_shape, scale.shape, shift.shape)
    return residual.new_empty(out_shape), residual.new_empty(residual_shape)


@torch.library.register_fake("flux2_fused::modnorm", lib=_LIB)
def _(x, scale, shift, eps):
    return x.new_empty(torch.broadcast_shapes(x.shape, scale.shape, shift.shape))
