"""diffusers as a host of the block code: which of its modules are plain, its attention, its adapters.

A `DiffusersHost` implements `flux2_fused.host.Host` for one family's diffusers classes (the
family's `Binding` names them): a module is plain where it is one of those classes (or a PyTorch
norm, activation or dropout) and nothing hooks or wraps it; modules and projections are called as
diffusers calls them, so peft's LoRA layers, quantized linears and offload hooks run; the attention
of a module whose processor the family maps is diffusers' own `dispatch_attention_fn` with the
processor's backend and parallel config, handed the q, k, v the processor would hand it. That
one choice makes every attention backend and context parallelism (whose exchange happens inside the
dispatch) run fused.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...host import Attention, ModuleHost, RMSNormParameters, methods_unpatched, output_dropout_inactive
from .slots import class_forward_signature

# The attention of a processor on the block code's q, k, v, or None where its own call must run:
# (host, processor, the call's attention options, the joint rows that are text) -> Attention | None.
AttentionFactory = Callable[["DiffusersHost", Any, Mapping[str, Any], int], Attention | None]

# PyTorch modules the families' block code computes itself where nothing wraps them.
TORCH_CLASSES = frozenset({nn.LayerNorm, nn.RMSNorm, nn.SiLU, nn.GELU, nn.Dropout})
# diffusers' own RMSNorm module (Qwen-Image's q/k norms): a family that lists it among its classes
# has it computed as its forward's pow/mean chain (`rms_norm`).
RMS_NORM = "diffusers.models.normalization.RMSNorm"


@dataclass(frozen=True)
class Binding:
    """How one family's diffusers transformer maps onto its block code.

    classes: the qualified names of the diffusers classes whose forward the block code reproduces
    (a class this diffusers lacks is skipped); processors: attention processor classes by qualified
    name, each with the attention it computes; forward(model, host, fusion, args, kwargs): the
    transformer's forward on the block code, or None where diffusers' own forward must run the call;
    blocks: block classes by qualified name, each with its forward on the block code
    (block, host, fusion, *args, **kwargs), None where the class forward must run: `enable` puts it
    under whatever calls a block (a cache's block container, block-level hooks, offloading).
    """

    classes: tuple[str, ...]
    processors: Mapping[str, AttentionFactory]
    forward: Callable[..., Any]
    blocks: Mapping[str, Callable[..., Any]] = field(default_factory=dict)


def resolve(qualified: str) -> type | None:
    """The class `package.module.Class` names, None where this diffusers has no such class."""
    module, _, name = qualified.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _npu_available() -> bool:
    """Whether diffusers' `RMSNorm` takes its Ascend NPU branch (`npu_rms_norm`) here."""
    from diffusers.utils import is_torch_npu_available

    return is_torch_npu_available()


def _resolved(names: Iterable[str]) -> dict[type, str]:
    return {cls: name for name in names if (cls := resolve(name)) is not None}


class DiffusersHost(ModuleHost):
    """The diffusers host for one family's binding (see the module docstring)."""

    def __init__(self, binding: Binding) -> None:
        # A block whose only wrapper is the fused block forward `enable` put there is plain.
        super().__init__(TORCH_CLASSES | frozenset(_resolved(binding.classes)), (FusedBlockForward,))
        self.binding = binding
        self.processors = {
            cls: binding.processors[name] for cls, name in _resolved(binding.processors).items()
        }
        self.block_forwards = {cls: binding.blocks[name] for cls, name in _resolved(binding.blocks).items()}
        # Looked up once: a torch.compile trace of `rms_norm` cannot import or ask for the device.
        self.rms_norm_class = resolve(RMS_NORM)
        self.rms_norm_forward_plain = self.rms_norm_class is not None and not _npu_available()

    def attention(
        self, attn: nn.Module, options: Mapping[str, Any] | None, text_tokens: int
    ) -> Attention | None:
        if not self._attention_plain(attn):
            return None
        processor = attn.processor
        factory = self.processors.get(type(processor))
        if factory is None or not methods_unpatched(type(processor), ("__call__",)):
            return None  # a processor class patched in place runs its own (replaced) call
        return factory(self, processor, options or {}, text_tokens)

    def rms_norm(self, module: nn.Module) -> RMSNormParameters | None:
        """`nn.RMSNorm` as PyTorch's host has it, and a plain diffusers `RMSNorm` with a weight and no
        bias as its forward computes it off Ascend NPUs (where it calls `npu_rms_norm` instead): the
        "mean" arithmetic."""
        if type(module) is self.rms_norm_class and self.plain(module):
            if module.weight is not None and module.bias is None and self.rms_norm_forward_plain:
                return RMSNormParameters(module.weight, module.eps, "mean")
            return None
        return super().rms_norm(module)

    def _attention_plain(self, attn: nn.Module) -> bool:
        """The attention module's forward may be replaced by the block code (its processor aside):
        a family class, no hooks, the parameter-free dropout of `to_out` (diffusers keeps one at
        index 1 in the double block) inactive. Fused projections (`fuse_qkv_projections()`) are the
        block code's too (`common.qkv_projections`)."""
        return self.plain(attn) and output_dropout_inactive(self, attn)

    @staticmethod
    def dispatch(
        processor: Any, mask: Callable[[torch.Tensor], torch.Tensor | None] | None = None
    ) -> Attention:
        """A processor's attention: diffusers' `dispatch_attention_fn` with the processor's backend
        and parallel config, on q, k, v as the processor passes them (under the attention mask
        `mask(query)` builds, where the processor masks), flattened and cast as the processor does. A
        context-parallel config exchanges rows with the other ranks in there. The function is looked
        up where the processor's own module finds it, so a tool that replaces it there (a
        module-level patch) is honored as it is in diffusers' own call."""
        dispatch_attention_fn = sys.modules[type(processor).__module__].dispatch_attention_fn

        def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            out = dispatch_attention_fn(
                query,
                key,
                value,
                attn_mask=None if mask is None else mask(query),
                backend=processor._attention_backend,
                parallel_config=processor._parallel_config,
            )
            return out.flatten(2, 3).to(query.dtype)

        return attend

    @staticmethod
    @contextlib.contextmanager
    def scaled_adapters(model: nn.Module, attention_kwargs: dict | None) -> Iterator[dict | None]:
        """diffusers' `apply_lora_scale` around a forward: a "scale" in the attention arguments scales
        every peft LoRA layer for the call; the rest goes on to the attention calls."""
        from diffusers.utils import USE_PEFT_BACKEND, scale_lora_layers, unscale_lora_layers

        extra = None
        scale = 1.0
        if attention_kwargs is not None:
            extra = dict(attention_kwargs)
            scale = extra.pop("scale", 1.0)
        if USE_PEFT_BACKEND:
            scale_lora_layers(model, scale)
        try:
            yield extra
        finally:
            if USE_PEFT_BACKEND:
                unscale_lora_layers(model, scale)

    def __repr__(self) -> str:
        return f"DiffusersHost({len(self.classes)} plain classes, {len(self.processors)} processors)"


class FusedBlockForward:
    """A block's forward under whatever calls it (a cache's block container, block-level hooks,
    offloading): the family's block forward with the patched transformer's host and switch, on real
    tensors in and out; the class forward where the family declines the call, where nothing enabled
    the block, where a forward replaced on the block's class must run, and under a torch.compile
    trace of the block (a block compiled on its own, as diffusers' `compile_repeated_blocks` does,
    compiles diffusers' own forward).

    `enable` puts one in each block's forward slot. A callable object, not a bound function, so that
    `DiffusersHost.plain` recognizes it with `isinstance` (which torch.compile traces); it shows the
    class forward's signature, for tools that match a block's pattern by it (cache-dit)."""

    __slots__ = ("__signature__", "block")

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.__signature__ = class_forward_signature(block)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        block = self.block
        # A forward replaced on the block's class (after `enable`, or before it) runs instead.
        if not torch.compiler.is_compiling() and methods_unpatched(type(block), ("forward",)):
            ref = getattr(block, "_flux2_fused_handle", None)  # patch.HandleRef to the enabling handle
            handle = ref() if ref is not None else None
            forward = None if handle is None else handle.host.block_forwards.get(type(block))
            out = None if forward is None else forward(block, handle.host, handle.fusion, *args, **kwargs)
            if out is not None:
                return out
        return type(block).forward(block, *args, **kwargs)
