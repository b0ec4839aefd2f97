"""Qwen-Image as diffusers writes it: the binding of `QwenImageTransformer2DModel` to the block code.

The diffusers host finds this module through its registry. The forward is diffusers' with the blocks
on the block code (streams pending between them), and keeps diffusers' semantics for every argument
that changes the math:
- `encoder_hidden_states_mask` (the text padding mask) is normalized as diffusers normalizes it and
  reaches every attention call, whose processor masks the padded text keys;
- `attention_kwargs`: a LoRA "scale" scales the adapters for the call (diffusers' `apply_lora_scale`);
  any other key goes to each attention call, which then runs as diffusers' own;
- `guidance` and `additional_t_cond` go to the time embedding as diffusers passes them;
- `controlnet_block_samples` are added to the image stream after each block, as diffusers adds them;
- a model with zero-timestep conditioning (`zero_cond_t`: the edit models' per-token modulation) and
  a call diffusers' forward would reject run diffusers' own forward (None).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...host import Attention, call_arguments
from ...integrations.diffusers.host import Binding, DiffusersHost
from ..common import call_double_block, output_norm
from ..deferral import Fusion, Stream, materialize
from . import blocks
from .blocks import (
    MASK,
    MODULE,
    attention_options,
    block_plain,
    double_block_call,
    host_rope,
)

# diffusers' forward's parameters in order (a caller may pass any of them positionally), with defaults.
PARAMETERS = {
    "hidden_states": None,
    "encoder_hidden_states": None,
    "encoder_hidden_states_mask": None,
    "timestep": None,
    "img_shapes": None,
    "guidance": None,
    "attention_kwargs": None,
    "controlnet_block_samples": None,
    "additional_t_cond": None,
    "return_dict": True,
}


def _attention(
    host: DiffusersHost, processor: Any, options: Mapping[str, Any], text_tokens: int
) -> Attention | None:
    """`QwenDoubleStreamAttnProcessor2_0`'s attention: diffusers' `dispatch_attention_fn` with the
    processor's backend and parallel config, under the joint mask it builds from the text padding
    mask (text keys as the mask says, every image key attended), flattened and cast as it does. Other
    arguments: the module's own call."""
    if not set(options) <= {MASK}:
        return None
    mask = options.get(MASK)
    if mask is None:
        return host.dispatch(processor)

    def joint_mask(query: torch.Tensor) -> torch.Tensor:
        image = torch.ones(
            (query.shape[0], query.shape[1] - text_tokens), dtype=torch.bool, device=query.device
        )
        return torch.cat([mask, image], dim=1)[:, None, None, :]

    return host.dispatch(processor, joint_mask)


def forward(model: nn.Module, host: DiffusersHost, fusion: Fusion, args: tuple, kwargs: dict) -> Any:
    """diffusers' `QwenImageTransformer2DModel.forward` on the block code; None where diffusers' own
    forward must run the call (see the module docstring)."""
    settings = call_arguments(PARAMETERS, args, kwargs)
    if (
        settings is None
        or model.zero_cond_t
        or not all(
            isinstance(settings[n], torch.Tensor)
            for n in ("hidden_states", "encoder_hidden_states", "timestep")
        )
        or settings["img_shapes"] is None
    ):
        return None
    qwen = sys.modules[MODULE]
    with host.scaled_adapters(model, kwargs.get("attention_kwargs")) as extra:
        if "attention_kwargs" not in kwargs:  # passed positionally (or not at all): goes on whole
            extra = settings["attention_kwargs"]
        x = host.linear(model.img_in, settings["hidden_states"])
        timestep = settings["timestep"].to(x.dtype)
        c = host.linear(model.txt_in, host.call(model.txt_norm, settings["encoder_hidden_states"]))
        text_tokens, _, mask = qwen.compute_text_seq_len_from_mask(c, settings["encoder_hidden_states_mask"])
        guidance, t_cond = settings["guidance"], settings["additional_t_cond"]
        if guidance is None:
            temb = host.call(model.time_text_embed, timestep, x, t_cond)
        else:
            temb = host.call(model.time_text_embed, timestep, guidance.to(x.dtype) * 1000, x, t_cond)
        rotary = host.call(
            model.pos_embed, settings["img_shapes"], max_txt_seq_len=text_tokens, device=x.device
        )
        out = _blocks(
            model, host, fusion, x, c, mask, temb, rotary, extra, settings["controlnet_block_samples"]
        )
        out = host.linear(model.proj_out, out)
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=out) if settings["return_dict"] else (out,)


def _blocks(
    model: nn.Module,
    host: DiffusersHost,
    fusion: Fusion,
    x: Stream,
    c: Stream,
    mask: torch.Tensor | None,
    temb: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],
    extra: dict | None,
    controlnet: list[torch.Tensor] | None,
) -> torch.Tensor:
    """The blocks in diffusers' order (each a plain block's body on the pending streams, else its own
    call on them materialized), each followed by its ControlNet residual, then the output norm of
    the image stream."""
    temb_act = F.silu(temb)  # each block's two modulation Linears read silu(temb): computed once
    rope = host_rope(rotary)
    options = attention_options(extra, mask)
    layers = model.transformer_blocks
    for index, block in enumerate(layers):
        if block_plain(host, block):
            x, c = blocks.double_block_body(block, host, fusion, x, c, temb_act, rope, options)
        else:
            x, c = call_double_block(
                host, block, x, c, rotary, extra, encoder_hidden_states_mask=mask, temb=temb
            )
        if controlnet is not None:
            x = materialize(x) + controlnet[index // math.ceil(len(layers) / len(controlnet))]
    return output_norm(model.norm_out, host, fusion, x, temb)


BINDING = Binding(
    classes=(
        f"{MODULE}.QwenImageTransformerBlock",
        "torch.nn.modules.container.Sequential",  # the blocks' img_mod / txt_mod: SiLU, Linear
        "diffusers.models.attention_processor.Attention",
        "diffusers.models.attention.FeedForward",
        "diffusers.models.activations.GELU",
        "diffusers.models.normalization.AdaLayerNormContinuous",
        "diffusers.models.normalization.RMSNorm",  # the q/k norms
    ),
    processors={f"{MODULE}.QwenDoubleStreamAttnProcessor2_0": _attention},
    forward=forward,
    blocks={f"{MODULE}.QwenImageTransformerBlock": double_block_call},
)
