"""`enable(model)` for ComfyUI's FLUX model: its `forward_orig` slot runs the family's ComfyUI binding.

ComfyUI's `Flux.forward` runs its wrappers, then `_forward` (patchify, reference latents, position
ids), which calls `self.forward_orig`: the one method that holds the blocks. `enable` puts a
`FusedForwardOrig` there, which runs the binding where it takes the call and ComfyUI's own method
elsewhere:
- on a `ModelPatcher` (what ComfyUI's nodes pass around as MODEL), as an object patch
  (`add_object_patch("diffusion_model.forward_orig", ...)`): ComfyUI sets it when it loads the model
  and removes it when it unloads it, clones carry it (a clone onto another model object gets a
  patch of that model, `_on_clone`), LoRA and other weight patches apply as they do without it, and
  another patcher of the same model (one the node was not applied to) runs ComfyUI's own method;
- on the bare `Flux` module (or a `BaseModel` holding it as `diffusion_model`), as an instance
  attribute.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ...host import class_named, qualified_name
from ...models.deferral import Fusion
from ...models.flux2.comfyui import make_fusion, make_host
from .. import kernels_state
from .host import ComfyHost

TRANSFORMER = "comfy.ldm.flux.model.Flux"
OBJECT_PATCH = "diffusion_model.forward_orig"
CALLBACK_KEY = "flux2_fused"


def is_comfy_flux(model: object) -> bool:
    """Whether `model` is ComfyUI's FLUX model (or a subclass), by qualified class name."""
    return isinstance(model, nn.Module) and class_named(type(model), (TRANSFORMER,)) is not None


@dataclass(repr=False)
class FusedHandle:
    """The patch of one ComfyUI FLUX model: `fusion.fused = False` keeps it but runs every site eager;
    `disable()` restores ComfyUI's own `forward_orig` (removes the object patch or the attribute)."""

    model: nn.Module
    host: ComfyHost
    fusion: Fusion
    patcher: Any = None  # the ModelPatcher holding the object patch, None for a bare module
    active: bool = True
    reasons: set[str] = field(default_factory=set)  # why calls ran ComfyUI's own forward, each once

    def declined(self, reason: str | None) -> None:
        """A call ran ComfyUI's own `forward_orig`: say why, once a reason (a node that changes nothing
        must not be silent)."""
        if reason is not None and reason not in self.reasons:
            self.reasons.add(reason)
            warnings.warn(
                f"flux2-fused: ComfyUI's own FLUX forward runs: {reason}", RuntimeWarning, stacklevel=3
            )

    def disable(self) -> None:
        self.active = False
        if self.patcher is not None:
            if isinstance(self.patcher.object_patches.get(OBJECT_PATCH), FusedForwardOrig):
                del self.patcher.object_patches[OBJECT_PATCH]
        elif isinstance(self.model.__dict__.get("forward_orig"), FusedForwardOrig):
            del self.model.__dict__["forward_orig"]

    def __repr__(self) -> str:
        """One line: the patch's state and, while it is active, whether kernels can run where the
        model is (`kernels_state`)."""
        state = f"active, {kernels_state(self.model)}" if self.active else "disabled"
        return f"FusedHandle(ComfyUI {type(self.model).__name__}, fused={self.fusion.fused}, {state})"


class FusedForwardOrig:
    """What sits in the model's `forward_orig` slot: the binding's forward where the handle is active
    and the binding takes the call, else the class's own `forward_orig`. It holds its model weakly
    (it is stored on the model itself and in patchers)."""

    __slots__ = ("handle", "model")

    def __init__(self, handle: FusedHandle) -> None:
        self.handle = handle
        self.model = weakref.ref(handle.model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from ...models.flux2 import comfyui as binding

        model = self.model()
        if model is None:  # the patch sits on another model than the one it was made for
            raise RuntimeError("flux2-fused: a FLUX patch outlived the model it was made for")
        handle = self.handle
        if handle.active:
            out, reason = binding.forward_orig(model, handle.host, handle.fusion, args, kwargs)
            if out is not None:
                return out
            handle.declined(reason)
        return type(model).forward_orig(model, *args, **kwargs)


def _diffusion_model(model: Any) -> tuple[nn.Module, Any]:
    """(the FLUX module, the ModelPatcher holding it or None) of a ModelPatcher, a `BaseModel` or
    the module itself; TypeError for anything else."""
    patcher = None
    if hasattr(model, "add_object_patch") and hasattr(model, "model"):  # a ModelPatcher
        patcher, model = model, model.model
    flux = getattr(model, "diffusion_model", model)
    if not is_comfy_flux(flux):
        raise TypeError(
            f"flux2-fused: expected ComfyUI's FLUX model ({TRANSFORMER}), a BaseModel or ModelPatcher "
            f"holding one, got {qualified_name(type(flux))}"
        )
    return flux, patcher


def _on_clone(original: Any, clone: Any) -> None:
    """A ModelPatcher clone's object patch for its own model: ComfyUI copies object patches by name,
    and some clones hold another model object than their original (TorchCompileModel's non-dynamic
    clone, a deep copy, a multi-GPU clone), for which the copied patch would run the original's
    blocks. Such a clone gets a patch of its own model, with the original's switches."""
    forward = clone.object_patches.get(OBJECT_PATCH)
    flux = getattr(clone.model, "diffusion_model", None)
    if not isinstance(forward, FusedForwardOrig) or forward.model() is flux:
        return
    if not is_comfy_flux(flux):
        del clone.object_patches[OBJECT_PATCH]
        return
    handle = forward.handle
    rebound = FusedHandle(flux, handle.host, make_fusion(handle.fusion.fused), clone, handle.active)
    clone.object_patches[OBJECT_PATCH] = FusedForwardOrig(rebound)


def enable(model: Any, fused: bool = True) -> FusedHandle:
    """Patch a ComfyUI FLUX model in place: a `ModelPatcher` (an object patch, applied when ComfyUI
    loads it; the node patches a clone), a `BaseModel`, or the `Flux` module itself. Returns the
    handle; `handle.disable()` undoes it."""
    flux, patcher = _diffusion_model(model)
    handle = FusedHandle(flux, make_host(), make_fusion(fused), patcher)
    forward = FusedForwardOrig(handle)
    if patcher is not None:
        from comfy.patcher_extension import CallbacksMP

        patcher.add_object_patch(OBJECT_PATCH, forward)
        patcher.remove_callbacks_with_key(CallbacksMP.ON_CLONE, CALLBACK_KEY)
        patcher.add_callback_with_key(CallbacksMP.ON_CLONE, CALLBACK_KEY, _on_clone)
    else:
        flux.forward_orig = forward
    return handle
