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


@dataclass
class PatchState:
    """What a patch's forward and its handle share: the host, the switch (`fusion.fused`), whether
    the patch is active, and the reasons calls ran ComfyUI's own forward. It refers to neither the
    model nor its patcher, which hold the patch: no reference cycle keeps either alive."""

    host: ComfyHost
    fusion: Fusion
    active: bool = True
    reasons: set[str] = field(default_factory=set)  # each warned once

    def declined(self, reason: str | None) -> None:
        """A call ran ComfyUI's own `forward_orig`: say why, once a reason (a node that changes nothing
        must not be silent)."""
        if reason is not None and reason not in self.reasons:
            self.reasons.add(reason)
            message = f"flux2-fused: ComfyUI's own FLUX forward runs: {reason}"
            warnings.warn(message, RuntimeWarning, stacklevel=3)


class FusedForwardOrig:
    """What sits in the model's `forward_orig` slot: the binding's forward where the patch is active
    and the binding takes the call, else the class's own `forward_orig`. It holds its model weakly
    (it is stored on the model itself and in patchers); a deep copy of the model gets a patch of the
    copy, with switches of its own."""

    __slots__ = ("model", "state")

    def __init__(self, model: nn.Module, state: PatchState) -> None:
        self.model = weakref.ref(model)
        self.state = state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from ...models.flux2 import comfyui as binding

        model = self.model()
        state = self.state
        if state.active:
            out, reason = binding.forward_orig(model, state.host, state.fusion, args, kwargs)
            if out is not None:
                return out
            state.declined(reason)
        return type(model).forward_orig(model, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> FusedForwardOrig:
        model = self.model()
        copied = memo.get(id(model), model)  # the model's copy, where the model itself is copied
        state = PatchState(self.state.host, make_fusion(self.state.fusion.fused), self.state.active)
        return FusedForwardOrig(copied, state)

    def __reduce__(self) -> Any:
        raise TypeError("flux2-fused: a patched ComfyUI model does not pickle; disable() its patch first")


@dataclass(repr=False)
class FusedHandle:
    """The patch of one ComfyUI FLUX model: `fusion.fused = False` keeps it but runs every site eager;
    `disable()` restores ComfyUI's own `forward_orig` (removes this patch's object patch or
    attribute, not another's). `reasons` are why calls ran ComfyUI's own forward."""

    model: nn.Module
    forward: FusedForwardOrig
    patcher: weakref.ref | None = None  # the ModelPatcher holding the object patch, None for a module

    @property
    def host(self) -> ComfyHost:
        return self.forward.state.host

    @property
    def fusion(self) -> Fusion:
        return self.forward.state.fusion

    @property
    def active(self) -> bool:
        return self.forward.state.active

    @active.setter
    def active(self, value: bool) -> None:
        self.forward.state.active = value

    @property
    def reasons(self) -> set[str]:
        return self.forward.state.reasons

    def disable(self) -> None:
        self.active = False
        patcher = None if self.patcher is None else self.patcher()
        if patcher is not None:
            if patcher.object_patches.get(OBJECT_PATCH) is self.forward:
                del patcher.object_patches[OBJECT_PATCH]
        elif self.model.__dict__.get("forward_orig") is self.forward:
            del self.model.__dict__["forward_orig"]

    def __repr__(self) -> str:
        """One line: the patch's state and, while it is active, whether kernels can run where the
        model is (`kernels_state`)."""
        state = f"active, {kernels_state(self.model)}" if self.active else "disabled"
        return f"FusedHandle(ComfyUI {type(self.model).__name__}, fused={self.fusion.fused}, {state})"


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
    state = forward.state
    rebound = PatchState(state.host, make_fusion(state.fusion.fused), state.active)
    clone.object_patches[OBJECT_PATCH] = FusedForwardOrig(flux, rebound)


def enable(model: Any, fused: bool = True) -> FusedHandle:
    """Patch a ComfyUI FLUX model in place: a `ModelPatcher` (an object patch, applied when ComfyUI
    loads it; the node patches a clone), a `BaseModel`, or the `Flux` module itself. Returns the
    handle; `handle.disable()` undoes it.

    Where another tool already replaced `forward_orig` (an object patch or an attribute: IP-Adapter
    and prompt-weighting nodes do), its replacement stays and runs, unfused: the handle comes back
    inactive, with the reason warned and in `handle.reasons`."""
    flux, patcher = _diffusion_model(model)
    forward = FusedForwardOrig(flux, PatchState(make_host(), make_fusion(fused)))
    handle = FusedHandle(flux, forward, None if patcher is None else weakref.ref(patcher))
    slots = patcher.object_patches if patcher is not None else flux.__dict__
    other = slots.get(OBJECT_PATCH if patcher is not None else "forward_orig")
    if other is not None and not isinstance(other, FusedForwardOrig):
        handle.active = False
        what = getattr(other, "__qualname__", None) or qualified_name(type(other))
        forward.state.declined(f"forward_orig is already replaced (by {what}); that replacement runs")
        return handle
    if patcher is not None:
        from comfy.patcher_extension import CallbacksMP

        patcher.add_object_patch(OBJECT_PATCH, forward)
        patcher.remove_callbacks_with_key(CallbacksMP.ON_CLONE, CALLBACK_KEY)
        patcher.add_callback_with_key(CallbacksMP.ON_CLONE, CALLBACK_KEY, _on_clone)
    else:
        flux.forward_orig = forward
    return handle
