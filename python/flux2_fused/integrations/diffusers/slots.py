"""Where a diffusers module's forward is held, so a fused forward can sit under every wrapper.

Hooks that wrap a module's forward and end in the class's forward (accelerate's `_old_forward`,
diffusers' hook registry: caches, offloading, context-parallel splitting) keep running when the
fused forward takes the class forward's place at the bottom of the chain, whichever was installed
first. The transformer and each of its blocks are patched this way.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

from torch import nn


def forward_slots(module: nn.Module) -> list[tuple[Any, str]]:
    """The places that hold a forward of the module, outermost first: the instance's own `forward`,
    accelerate's `_old_forward` (what its hook calls: model CPU offload, device maps), and the
    function references of diffusers' hook registry (each hook calls the next one down, the last the
    module's forward: context-parallel splitting, caches, group offloading).
    Only slots that hold something are listed."""
    slots = [(module, "forward"), (module, "_old_forward")]
    registry = getattr(module, "_diffusers_hook", None)
    for ref in reversed(getattr(registry, "_fn_refs", [])):
        # A hook with its own `new_forward` keeps what it calls in `original_forward`.
        slots += [(ref, "forward"), (ref, "original_forward")]
    return [(holder, name) for holder, name in slots if getattr(holder, name, None) is not None]


def class_forward_signature(module: nn.Module) -> inspect.Signature:
    """The signature of the module's class forward bound to it: what a fused forward object shows,
    for callers that inspect the forward (pipelines checking its arguments, cache-dit matching
    blocks)."""
    return inspect.signature(types.MethodType(type(module).forward, module))


def binds_class_forward(fn: Any, module: nn.Module) -> bool:
    """Whether `fn` is the module's class forward bound to the module (what a wrapper ends in)."""
    bound_to = getattr(fn, "__self__", None)
    return bound_to is module and getattr(fn, "__func__", None) is type(module).forward


def install(module: nn.Module, method: Any, *, outermost: bool) -> tuple[bool, Any]:
    """Put `method` where the class forward is called: in the slot of a wrapper that ends in the class
    forward, or as the instance's forward where there is none. A forward of unknown kind set on the
    instance stays where it is: with `outermost` the method goes above it (and the caller keeps it
    to call), else nothing is installed. Returns (installed, that forward of unknown kind or None)."""
    for holder, name in forward_slots(module):
        if binds_class_forward(getattr(holder, name), module):
            setattr(holder, name, method)
            return True, None
    previous = module.__dict__.get("forward")
    if previous is not None and not outermost:
        return False, None
    module.forward = method
    return True, previous


def uninstall(module: nn.Module, method: Any, previous: Any = None) -> None:
    """Undo `install`: the class forward (or `previous`, as the instance's forward) where `method`
    sits; wrappers added since stay."""
    for holder, name in forward_slots(module):
        if getattr(holder, name) is not method:
            continue
        if holder is module and name == "forward":
            del module.__dict__["forward"]
            if previous is not None:
                module.forward = previous
        else:
            setattr(holder, name, types.MethodType(type(module).forward, module))
        return
