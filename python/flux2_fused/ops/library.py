"""The fused ops as torch.library custom ops, so torch.compile keeps them instead of breaking the graph.

`torch.ops.flux2_fused.gated_resnorm(residual, update, gate, scale, shift, eps) -> (out, residual_out)`
and `torch.ops.flux2_fused.modnorm(x, scale, shift, eps) -> out` always return exactly what the eager
chain returns: the fused kernel where the guards accept (checked when the op runs, not when it is
traced), the eager ops everywhere else (CPU, other dtypes, a failed self-check). Their fake
implementations give Inductor the output shapes, so a compiled model plans around them; Inductor's
own fusion of this chain keeps fp32 intermediates and is not bit-exact, ours is.

The model's eager path calls `gated_resnorm.launch` directly: the custom-op dispatch costs a few
microseconds a call on the host (measured in test_library.py's report), which eager mode need not pay.
"""

from __future__ import annotations

import torch

from . import gated_resnorm as ops


@torch.library.custom_op("flux2_fused::gated_resnorm", mutates_args=())
def gated_resnorm(
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


@gated_resnorm.register_fake
def _(residual, update, gate, scale, shift, eps):
    residual_shape = torch.broadcast_shapes(residual.shape, gate.shape, update.shape)
    out_shape = torch.broadcast_shapes(residual_shape, scale.shape, shift.shape)
    return residual.new_empty(out_shape), residual.new_empty(residual_shape)


@torch.library.custom_op("flux2_fused::modnorm", mutates_args=())
def modnorm(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    """`(1 + scale) * layer_norm(x) + shift`, bit-exact to eager."""
    if ops.can_use_flux2_modnorm(x, scale, shift):
        return ops.modnorm_unchecked(x, scale, shift, eps)
    return ops.modnorm_reference(x, scale, shift, eps)


@modnorm.register_fake
def _(x, scale, shift, eps):
    return x.new_empty(torch.broadcast_shapes(x.shape, scale.shape, shift.shape))
