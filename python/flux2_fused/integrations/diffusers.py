"""One-call patch of a diffusers `Flux2Transformer2DModel` onto the fused, deferred-residual forward.

    from flux2_fused.integrations.diffusers import enable
    handle = enable(pipe.transformer)   # outputs stay bit-identical; faster on a CUDA GPU
    ...
    handle.disable()                    # the original forward again

The patch builds a `Flux2Transformer` on the meta device and points its parameters at the diffusers
model's own tensors (no copy, no extra memory), then routes `forward` through it. Our model runs
diffusers' eager ops in diffusers' order, so the output is bit-identical; on the GPU the residual
sites go through the fused kernel where it is proven exact. Every call first checks that this still
holds: the same parameters in the same storage as at `enable()` (an adapter, a replaced weight, a
dtype or device move breaks that) and diffusers' default attention processor on the native backend.
Calls it cannot vouch for (those, KV-cache modes, joint_attention_kwargs, hooks on the diffusers
submodules, gradient checkpointing while training) go to diffusers' own forward unchanged.
"""

from __future__ import annotations

import importlib.metadata
import types
from dataclasses import dataclass
from typing import Any

import torch

from ..models.flux2 import Flux2Config, Flux2Transformer

SUPPORTED_DIFFUSERS = ((0, 37), (0, 43))  # [min, max): the FLUX.2 transformer's math is unchanged here


def _check_version() -> str:
    try:
        version = importlib.metadata.version("diffusers")
    except importlib.metadata.PackageNotFoundError as err:
        raise RuntimeError("flux2-fused: diffusers is not installed") from err
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    low, high = SUPPORTED_DIFFUSERS
    if not (low <= parts < high):
        raise RuntimeError(
            f"flux2-fused: diffusers {version} is outside the supported range "
            f">={low[0]}.{low[1]},<{high[0]}.{high[1]} (FLUX.2's transformer may differ there)"
        )
    return version


@dataclass
class FusedHandle:
    """What `enable` returns: the model it routes through, the weights that model mirrors, and
    `disable()` to undo the patch."""

    transformer: torch.nn.Module
    model: Flux2Transformer | None  # None: the module's layout was not FLUX.2's plain one at enable()
    weights: list[tuple[str, int, torch.dtype, torch.device, torch.Size]]

    def disable(self) -> None:
        """Restore diffusers' own forward."""
        if self.transformer.__dict__.get("forward") is not None:
            del self.transformer.forward
        self.transformer._flux2_fused_handle = None


def _has_submodule_hooks(module: torch.nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules() if m is not module)


def _weights(module: torch.nn.Module) -> list[tuple[str, int, torch.dtype, torch.device, torch.Size]]:
    """Every parameter's name and storage: what the routed model must still share to compute what
    diffusers' modules compute."""
    return [(name, p.data_ptr(), p.dtype, p.device, p.shape) for name, p in module.named_parameters()]


def _default_attention(transformer: torch.nn.Module) -> bool:
    """Every block runs diffusers' default FLUX.2 processor on the native (SDPA) backend, which is
    what the routed model's attention computes."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
    from diffusers.models.transformers.transformer_flux2 import (
        Flux2AttnProcessor,
        Flux2ParallelSelfAttnProcessor,
    )

    native = AttentionBackendName.NATIVE
    blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    for block in blocks:
        processor = block.attn.processor
        if type(processor) not in (Flux2AttnProcessor, Flux2ParallelSelfAttnProcessor):
            return False
        backend = processor._attention_backend or _AttentionBackendRegistry._active_backend
        if AttentionBackendName(backend) != native:
            return False
    return True


def _mirrors(transformer: torch.nn.Module, handle: FusedHandle) -> bool:
    """Whether the routed model still computes exactly what diffusers' forward would: the same
    parameters in the same storage (no adapter, replaced weight, dtype or device move since
    `enable()`) and the default attention. Never raises: anything unexpected means no."""
    try:
        if handle.model is None or _weights(transformer) != handle.weights:
            return False
        return _default_attention(transformer)
    except Exception:
        return False


def _patched_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor = None,
    timestep: torch.Tensor = None,
    img_ids: torch.Tensor = None,
    txt_ids: torch.Tensor = None,
    guidance: torch.Tensor = None,
    joint_attention_kwargs: dict | None = None,
    return_dict: bool = True,
    **kwargs: Any,
) -> Any:
    """The fused model where it provably computes diffusers' forward, else diffusers' forward.

    Bound to the transformer as a method, so a `copy.deepcopy` of the module binds the copy (whose
    weights live elsewhere, so it takes diffusers' forward)."""
    handle: FusedHandle = self._flux2_fused_handle
    supported = not (
        joint_attention_kwargs
        or any(v not in (None, 0, 0.0) for v in kwargs.values())
        or _has_submodule_hooks(self)
        or (torch.is_grad_enabled() and getattr(self, "gradient_checkpointing", False))
        or not _mirrors(self, handle)
    )
    if not supported:
        return type(self).forward(
            self,
            hidden_states,
            encoder_hidden_states,
            timestep,
            img_ids,
            txt_ids,
            guidance,
            joint_attention_kwargs=joint_attention_kwargs,
            return_dict=return_dict,
            **kwargs,
        )
    sample = handle.model(hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, guidance)
    if not return_dict:
        return (sample,)
    from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModelOutput

    return Flux2Transformer2DModelOutput(sample=sample)


def enable(transformer: torch.nn.Module, fused: bool = True) -> FusedHandle:
    """Patch `transformer` (a diffusers Flux2Transformer2DModel) in place; returns a handle."""
    _check_version()
    if type(transformer).__name__ != "Flux2Transformer2DModel":
        raise TypeError(
            f"flux2-fused: expected a diffusers Flux2Transformer2DModel, got {type(transformer).__name__}"
        )
    existing = getattr(transformer, "_flux2_fused_handle", None)
    if existing is not None:
        return existing
    config = Flux2Config.from_diffusers(dict(transformer.config))
    with torch.device("meta"):
        model = Flux2Transformer(config, fused=fused)
    state = transformer.state_dict()
    if set(state) != set(model.state_dict()):
        # Adapters or other wrappers already change the module layout: this model cannot mirror it,
        # so every call takes diffusers' forward.
        model = None
    else:
        model.load_state_dict(state, strict=True, assign=True)
    handle = FusedHandle(transformer, model, _weights(transformer) if model is not None else [])
    transformer._flux2_fused_handle = handle
    transformer.forward = types.MethodType(_patched_forward, transformer)
    return handle
