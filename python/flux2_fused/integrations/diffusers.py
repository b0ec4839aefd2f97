"""One-call patch of a diffusers `Flux2Transformer2DModel` onto the fused, deferred-residual forward.

    from flux2_fused.integrations.diffusers import enable
    handle = enable(pipe.transformer)   # outputs stay bit-identical; faster on a CUDA GPU
    ...
    handle.disable()                    # the original forward again

The patch builds a `Flux2Transformer` on the meta device and points its parameters at the diffusers
model's own tensors (no copy, no extra memory), then routes `forward` through it. Our model runs
diffusers' eager ops in diffusers' order, so the output is bit-identical; on the GPU the residual
sites go through the fused kernel where it is proven exact. Calls the patch does not cover (KV-cache
modes, joint_attention_kwargs, hooks on the diffusers submodules, gradient checkpointing while
training) go to diffusers' original forward unchanged.
"""

from __future__ import annotations

import importlib.metadata
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
    """What `enable` returns: the shadow model it routes through, and `disable()` to undo the patch."""

    transformer: torch.nn.Module
    model: Flux2Transformer

    def disable(self) -> None:
        """Restore diffusers' own forward."""
        if self.transformer.__dict__.get("forward") is not None:
            del self.transformer.forward
        self.transformer._flux2_fused_handle = None


def _has_submodule_hooks(module: torch.nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules() if m is not module)


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
    model.load_state_dict(transformer.state_dict(), strict=True, assign=True)
    original = transformer.forward

    def forward(
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
        unsupported = (
            joint_attention_kwargs
            or any(v not in (None, 0, 0.0) for v in kwargs.values())
            or _has_submodule_hooks(transformer)
            or (torch.is_grad_enabled() and getattr(transformer, "gradient_checkpointing", False))
        )
        if unsupported:
            return original(
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
        sample = model(hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, guidance)
        if not return_dict:
            return (sample,)
        from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModelOutput

        return Flux2Transformer2DModelOutput(sample=sample)

    transformer.forward = forward
    handle = FusedHandle(transformer, model)
    transformer._flux2_fused_handle = handle
    return handle
