"""FLUX.3 as diffusers writes it: the binding of `Flux3Transformer2DModel` to the family's block code.

The diffusers host finds this module through its registry. The forward keeps diffusers' semantics
for every argument:
- `attention_kwargs`: a LoRA "scale" scales the adapters for the call (passed by keyword, as
  diffusers' `apply_lora_scale` reads it); diffusers passes nothing else on to the blocks;
- reference images (`image_cond_hidden_states` with `image_cond_ids`) run their own mode stack and
  join the content rows of the joint blocks; the flow map's `target_timestep` is embedded and added
  to every mode's time embedding;
- a call diffusers' forward would reject (malformed arguments, reference rows without ids, a
  `target_timestep` a model does or does not take) returns None, so diffusers' own forward raises
  its error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...host import Attention, call_arguments
from ...integrations.diffusers.host import Binding, DiffusersHost
from ..common import Rope, layer_norms_plain
from ..deferral import Fusion
from .blocks import conditioning, mode_block_call, single_block_call, transformer

MODULE = "diffusers.models.transformers.transformer_flux3"
# diffusers' forward's parameters in order (a caller may pass any of them positionally), with defaults.
PARAMETERS = {
    "hidden_states": None,
    "encoder_hidden_states": None,
    "timestep": None,
    "img_ids": None,
    "txt_ids": None,
    "image_cond_hidden_states": None,
    "image_cond_ids": None,
    "target_timestep": None,
    "attention_kwargs": None,
    "return_dict": True,
}
TENSORS = ("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids")


def _default_attention(
    host: DiffusersHost, processor: Any, options: Any, text_tokens: int
) -> Attention | None:
    """`Flux3AttnProcessor`'s attention; the blocks pass it no other arguments."""
    return host.dispatch(processor) if not options else None


def _accepted(model: nn.Module, settings: dict[str, Any]) -> bool:
    """Whether diffusers' forward would take these arguments (else it raises, and should)."""
    if not all(isinstance(settings[name], torch.Tensor) for name in TENSORS):
        return False
    cond, cond_ids = settings["image_cond_hidden_states"], settings["image_cond_ids"]
    if (cond is None) != (cond_ids is None):
        return False
    return (settings["target_timestep"] is not None) == bool(model.config.flow_map)


def forward(model: nn.Module, host: DiffusersHost, fusion: Fusion, args: tuple, kwargs: dict) -> Any:
    """diffusers' `Flux3Transformer2DModel.forward` on the block code; None where diffusers' own
    forward must run the call (see the module docstring)."""
    settings = call_arguments(PARAMETERS, args, kwargs)
    if settings is None or not _accepted(model, settings):
        return None
    with host.scaled_adapters(model, kwargs.get("attention_kwargs")):
        cond = conditioning(
            model,
            host,
            settings["hidden_states"],
            settings["encoder_hidden_states"],
            settings["timestep"],
            settings["img_ids"],
            settings["txt_ids"],
            settings["image_cond_hidden_states"],
            settings["image_cond_ids"],
            settings["target_timestep"],
        )
        out = transformer(model, host, fusion, cond)
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=out) if settings["return_dict"] else (out,)


def mode_block_forward(
    block: nn.Module,
    host: DiffusersHost,
    fusion: Fusion,
    hidden_states: torch.Tensor,
    temb_mod: torch.Tensor,
    image_rotary_emb: Rope,
) -> torch.Tensor | None:
    """`Flux3ModeTransformerBlock.forward` on the block code, for a caller other than the loop (a
    cache, a hook); None (diffusers' own forward) where the block's norm is not plain."""
    if not layer_norms_plain(host, block, ("norm",)):  # hooks on the block itself called this
        return None
    return mode_block_call(block, host, fusion, hidden_states, temb_mod, image_rotary_emb)


def single_block_forward(
    block: nn.Module,
    host: DiffusersHost,
    fusion: Fusion,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb_mod: torch.Tensor,
    temb_mod_context: torch.Tensor,
    image_rotary_emb: Rope,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`Flux3SingleTransformerBlock.forward` on the block code, (text, content) back; None as in
    `mode_block_forward`."""
    if not layer_norms_plain(host, block, ("norm",)):  # hooks on the block itself called this
        return None
    return single_block_call(
        block,
        host,
        fusion,
        hidden_states,
        encoder_hidden_states,
        temb_mod,
        temb_mod_context,
        image_rotary_emb,
    )


BINDING = Binding(
    classes=(
        f"{MODULE}.Flux3ModeTransformerBlock",
        f"{MODULE}.Flux3SingleTransformerBlock",
        f"{MODULE}.Flux3Attention",
        f"{MODULE}.Flux3FeedForward",
        f"{MODULE}.Flux3SwiGLU",
        f"{MODULE}.Flux3AdaLayerNorm",
    ),
    processors={f"{MODULE}.Flux3AttnProcessor": _default_attention},
    forward=forward,
    blocks={
        f"{MODULE}.Flux3ModeTransformerBlock": mode_block_forward,
        f"{MODULE}.Flux3SingleTransformerBlock": single_block_forward,
    },
)
