"""Where a diffusers model's forward is held, so the fused forward can sit under every wrapper.

Hooks that wrap a model's forward and end in the class's forward (accelerate's `_old_forward`,
diffusers' hook registry) keep running when the fused forward takes the class forward's place at
the bottom of the chain, whichever was installed first.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def forward_slots(model: nn.Module) -> list[tuple[Any, str]]:
    """The places that hold a forward of the model, outermost first: the instance's own `forward`,
    accelerate's `_old_forward` (what its hook calls: model CPU offload, device maps), and the
    function references of diffusers' hook registry (each hook calls the next one down, the last the
    module's forward: context-parallel splitting, caches, group offloading).
    Only slots that hold something are listed."""
    slots = [(model, "forward"), (model, "_old_forward")]
    registry = getattr(model, "_diffusers_hook", None)
    for ref in reversed(getattr(registry, "_fn_refs", [])):
        # A hook with its own `new_forward` keeps what it calls in `original_forward`.
        slots += [(ref, "forward"), (ref, "original_forward")]
    return [(holder, name) for holder, name in slots if getattr(holder, name, None) is not None]


def binds_class_forward(fn: Any, model: nn.Module) -> bool:
    """Whether `fn` is the model's class forward bound to the model (what a wrapper ends in)."""
    bound_to = getattr(fn, "__self__", None)
    return bound_to is model and getattr(fn, "__func__", None) is type(model).forward
