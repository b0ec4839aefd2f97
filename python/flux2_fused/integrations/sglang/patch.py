"""`enable(model)` for sglang's FLUX.2 DiT, and the forward the sglang plugin wraps around its class.

Both routes run one function, `fused_call`: the family's sglang binding where it takes the call, else
sglang's own forward. `enable` puts it in the instance's forward slot (a handle undoes it); the plugin
(`plugin.register`, found through sglang's diffusion plugin entry point) wraps the class's forward,
so every sglang DiT the runtime builds runs it, with no change to sglang and no flag.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ...host import class_named, qualified_name
from ...models.deferral import Fusion
from .. import kernels_state
from .host import SglangHost

TRANSFORMER = "sglang.multimodal_gen.runtime.models.dits.flux_2.Flux2Transformer2DModel"


def is_sglang_dit(model: object) -> bool:
    """Whether `model` is sglang's FLUX.2 DiT (or a subclass), by qualified class name along its MRO:
    diffusers' transformer has the same class name."""
    return isinstance(model, nn.Module) and class_named(type(model), (TRANSFORMER,)) is not None


@dataclass(repr=False)
class FusedHandle:
    """The patch of one sglang DiT: `fusion.fused = False` keeps it but runs every site eager;
    `disable()` restores sglang's own forward (an `enable` patch is removed, a plugin-wrapped class
    forward passes the model through)."""

    model: nn.Module
    host: SglangHost
    fusion: Fusion
    active: bool = True

    def disable(self) -> None:
        self.active = False
        forward = self.model.__dict__.get("forward")
        if isinstance(forward, types.MethodType) and forward.__func__ is _enabled_forward:
            del self.model.__dict__["forward"]

    def __repr__(self) -> str:
        """One line: the patch's state and, while it is active, whether kernels can run where the
        DiT is (`kernels_state`)."""
        state = f"active, {kernels_state(self.model)}" if self.active else "disabled"
        return f"FusedHandle(sglang {type(self.model).__name__}, fused={self.fusion.fused}, {state})"


def handle_for(model: nn.Module, fused: bool = True) -> FusedHandle:
    """The model's handle, made on first use (a plugin-wrapped model gets one on its first call)."""
    handle = model.__dict__.get("_flux2_fused_handle")
    if handle is None:
        from ...models.flux2.sglang import make_host

        handle = FusedHandle(model, make_host(), Fusion(fused=fused))
        model.__dict__["_flux2_fused_handle"] = handle
    return handle


def fused_call(original: Callable[..., Any], model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The model's call on the block code where the binding takes it, else `original` (sglang's
    forward, unbound)."""
    from ...models.flux2 import sglang as binding

    handle = handle_for(model)
    if handle.active:
        out = binding.forward(model, handle.host, handle.fusion, args, kwargs)
        if out is not None:
            return out
    return original(model, *args, **kwargs)


def _enabled_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return fused_call(type(self).forward, self, *args, **kwargs)


def enable(model: Any, fused: bool = True) -> FusedHandle:
    """Patch one sglang FLUX.2 DiT (or an object holding it as `.transformer`) in place; returns its
    handle. Enabling twice returns the same handle, active again."""
    model = getattr(model, "transformer", model)
    if not is_sglang_dit(model):
        raise TypeError(
            f"flux2-fused: expected sglang's FLUX.2 DiT ({TRANSFORMER}), got {qualified_name(type(model))}"
        )
    handle = handle_for(model, fused)
    handle.active = True
    handle.fusion.fused = fused
    if model.__dict__.get("forward") is None:
        model.forward = types.MethodType(_enabled_forward, model)
    return handle
