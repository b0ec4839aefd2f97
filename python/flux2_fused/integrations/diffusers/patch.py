"""`enable(transformer or pipeline)`: the fused forwards put in the model's and its blocks' forward
slots, and the handle that undoes it.

Everything the patch puts on the model copies and pickles with it: `copy.deepcopy` gives a patched
copy with a handle of its own, and `torch.save(model)` / `torch.load` a patched model (a model saved
alone carries its patch; a block saved alone carries none, so its forward is diffusers')."""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from ...host import methods_unpatched, qualified_name
from ...models.deferral import Fusion
from .host import DiffusersHost, FusedBlockForward
from .registry import FAMILIES, binding_for
from .slots import class_forward_signature, forward_slots, install, uninstall
from .version import check_version


class HandleRef:
    """A block's weak reference to the handle that enabled it: a block copied or saved on its own does
    not carry the whole model with it. Called, it gives the handle or None. A deep copy is the same
    reference (the handle's own copy points its blocks anew); a pickled one is empty until the
    handle saved with it points it (`FusedHandle.__setstate__`)."""

    __slots__ = ("_ref",)

    def __init__(self, handle: FusedHandle | None = None) -> None:
        self._ref = None if handle is None else weakref.ref(handle)

    def __call__(self) -> FusedHandle | None:
        return None if self._ref is None else self._ref()

    def point(self, handle: FusedHandle) -> None:
        self._ref = weakref.ref(handle)

    def __deepcopy__(self, memo: dict) -> HandleRef:
        return self

    def __reduce__(self) -> tuple:
        return HandleRef, ()


class FusedForward:
    """The transformer's fused forward (`_fused_forward` on its transformer), as the object that sits
    in its forward slot: it copies and pickles with the model, and shows the class forward's
    signature to whoever inspects `transformer.forward` (a pipeline checking what it accepts)."""

    __slots__ = ("__signature__", "transformer")

    def __init__(self, transformer: nn.Module) -> None:
        self.transformer = transformer
        self.__signature__ = class_forward_signature(transformer)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _fused_forward(self.transformer, *args, **kwargs)

    def __get__(self, instance: Any, owner: Any = None) -> FusedForward:
        """Binding it again gives itself, as binding a bound method does (cache-dit restores a
        forward it saved with `saved.__get__(transformer)`)."""
        return self


@dataclass(repr=False)
class FusedHandle:
    """What `enable` returns: the switch of the patched transformer, and `disable()` to undo it.

    `fusion.fused = False` keeps the patch but runs every site eager (for A/B comparisons). `method`
    is the transformer's `FusedForward`, wherever it sits in the forward's wrappers;
    `previous_forward` is a forward of unknown kind that was set on the instance before `enable`
    (every call then goes through it, unfused), restored by `disable`; `blocks` are the blocks whose
    forward slot holds the fused block forward, with the one that sits there; `refs` the blocks'
    references to this handle.
    """

    transformer: nn.Module
    host: DiffusersHost
    fusion: Fusion
    method: Any
    previous_forward: Any = None
    blocks: list[tuple[nn.Module, Any]] = field(default_factory=list)
    refs: list[HandleRef] = field(default_factory=list)
    # True while `previous_forward` runs: a call that comes back into the fused forward from inside it
    # (a wrapper that ends in an older fused forward) runs diffusers' own forward, instead of looping.
    calling_previous: bool = False

    def __deepcopy__(self, memo: dict) -> FusedHandle:
        """A copy of the patched model gets its own handle, and its blocks point to that one (a
        block's reference to its handle is copied as it is)."""
        copied = FusedHandle.__new__(FusedHandle)
        memo[id(self)] = copied
        for item in fields(self):
            setattr(copied, item.name, copy.deepcopy(getattr(self, item.name), memo))
        copied.refs = [HandleRef(copied) for _ in copied.blocks]
        for (block, _), ref in zip(copied.blocks, copied.refs, strict=True):
            block._flux2_fused_handle = ref
        return copied

    def __setstate__(self, state: dict) -> None:
        """Unpickled: the blocks' references (unpickled empty, as the same objects) point here."""
        self.__dict__.update(state)
        for ref in self.refs:
            ref.point(self)

    def __repr__(self) -> str:
        """One line: the patch's state and, while it is active, whether kernels can run where the
        transformer is (`kernels_state`)."""
        from .. import kernels_state

        active = getattr(self.transformer, "_flux2_fused_handle", None) is self
        state = f"active, {kernels_state(self.transformer)}" if active else "disabled"
        return f"FusedHandle({type(self.transformer).__name__}, fused={self.fusion.fused}, {state})"

    def disable(self) -> None:
        """Restore the transformer's and the blocks' forwards as they were before `enable`, wrappers
        added since kept."""
        uninstall(self.transformer, self.method, self.previous_forward)
        if getattr(self.transformer, "_flux2_fused_handle", None) is self:
            self.transformer._flux2_fused_handle = None
        for block, method in self.blocks:
            uninstall(block, method)
            block._flux2_fused_handle = None
        self.blocks.clear()
        self.refs.clear()


def _fused_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The model's forward through its family's binding where that implements the call, else the
    class's forward (diffusers', or whatever replaced it on the class: a TeaCache-style forward,
    whose block calls still run fused) or the forward of unknown kind set before `enable`."""
    handle: FusedHandle | None = getattr(self, "_flux2_fused_handle", None)
    if (
        handle
        is not None  # else the handle was disabled while this method stayed reachable (another wrapper)
        and handle.previous_forward is None
        and methods_unpatched(type(self), ("forward",))  # a forward replaced on the class runs instead
        # gradient checkpointing while a gradient is needed: diffusers' forward checkpoints each block
        and not (torch.is_grad_enabled() and getattr(self, "gradient_checkpointing", False))
    ):
        out = handle.host.binding.forward(self, handle.host, handle.fusion, args, kwargs)
        if out is not None:
            return out
    if handle is not None and handle.previous_forward is not None and not handle.calling_previous:
        handle.calling_previous = True
        try:
            return handle.previous_forward(*args, **kwargs)
        finally:
            handle.calling_previous = False
    return type(self).forward(self, *args, **kwargs)


def enable(model: Any, fused: bool = True) -> FusedHandle:
    """Patch a diffusers transformer of a supported family (`registry.FAMILIES`), or a pipeline's
    `.transformer`, in place; returns a handle. Enabling twice returns the same handle."""
    check_version()
    transformer = getattr(model, "transformer", model)
    binding = binding_for(transformer) if isinstance(transformer, nn.Module) else None
    if binding is None:
        supported = ", ".join(name.rpartition(".")[2] for name in FAMILIES)
        raise TypeError(
            f"flux2-fused: expected a diffusers transformer ({supported}) or a pipeline holding one, "
            f"got {qualified_name(type(model))}"
        )
    existing = getattr(transformer, "_flux2_fused_handle", None)
    if existing is not None:
        if any(getattr(holder, name) is existing.method for holder, name in forward_slots(transformer)):
            return existing
        existing.disable()  # its forward was replaced from outside since: undo the rest, install afresh
    method = FusedForward(transformer)
    # Under wrappers that end in the class's forward (accelerate's and diffusers' hooks), the fused
    # forward takes its place there, so the wrappers run around it; a wrapper of unknown kind stays
    # outermost and is called whole (unfused).
    _, previous = install(transformer, method, outermost=True)
    host = DiffusersHost(binding)
    handle = FusedHandle(transformer, host, Fusion(fused=fused), method, previous)
    transformer._flux2_fused_handle = handle
    # Each block's fused forward, under whatever wraps the block or calls it instead of the loop (a
    # cache's block container, block-level hooks and offloading); a block wrapped by a forward of
    # unknown kind keeps it, unfused.
    for module in transformer.modules():
        if type(module) in host.block_forwards:
            block_method = FusedBlockForward(module)
            if install(module, block_method, outermost=False)[0]:
                ref = HandleRef(handle)
                module._flux2_fused_handle = ref
                handle.blocks.append((module, block_method))
                handle.refs.append(ref)
    return handle
