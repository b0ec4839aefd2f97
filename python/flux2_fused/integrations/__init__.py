"""Integrations with other libraries (diffusers, sglang), and what their patch handles share."""

from __future__ import annotations

from torch import nn

from ..ops import fast_path_reason


def kernels_state(model: nn.Module) -> str:
    """Whether the fused kernels can run for `model` where it is now (the device and dtype of its
    first parameter), for a patch handle's repr: "active" alone would read as fused kernels running
    on a CPU model, where every site runs its eager chain."""
    param = next(model.parameters(), None)
    if param is None:
        return "kernels off here: the model has no parameters"
    reason = fast_path_reason(param.device, param.dtype)
    return f"kernels can run on {param.device}" if reason is None else f"kernels off here: {reason}"
