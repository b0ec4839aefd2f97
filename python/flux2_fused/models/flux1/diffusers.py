"""FLUX.1 as diffusers writes it: the binding of `FluxTransformer2DModel` to the family's block code.

The diffusers host finds this module through its registry. The forward keeps diffusers' semantics for
every argument that changes the block math:
- `joint_attention_kwargs`: a LoRA "scale" scales the adapters for the call (passed by keyword, as
  diffusers' `apply_lora_scale` reads it); `ip_adapter_image_embeds` is projected by the model's
  `encoder_hid_proj` into `ip_hidden_states` for the attention calls, as diffusers does (the
  IP-Adapter processors then run as module calls inside the fused blocks; the default processor,
  which the single blocks keep, drops those arguments as diffusers' attention module does); any
  other key goes to each attention call, which then runs as diffusers' own;
- `controlnet_block_samples` / `controlnet_single_block_samples` (and `controlnet_blocks_repeat`)
  are added to the image stream after each block, as diffusers adds them;
- 3-D `img_ids` / `txt_ids` are deprecated in diffusers, which warns and takes the first row: so do we;
- a call diffusers' forward would reject (malformed arguments, missing inputs) returns None, so
  diffusers' own forward raises its error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ...host import Attention, Host, call_arguments
from ...integrations.diffusers.host import Binding, DiffusersHost
from ..common import Options, Rope
from ..deferral import Fusion
from .blocks import (
    ControlNet,
    conditioning,
    double_block_call,
    double_norms_plain,
    modulation_plain,
    single_block_call,
    transformer,
)

MODULE = "diffusers.models.transformers.transformer_flux"
# diffusers' forward's parameters in order (a caller may pass any of them positionally), with defaults.
PARAMETERS = {
    "hidden_states": None,
    "encoder_hidden_states": None,
    "pooled_projections": None,
    "timestep": None,
    "img_ids": None,
    "txt_ids": None,
    "guidance": None,
    "joint_attention_kwargs": None,
    "controlnet_block_samples": None,
    "controlnet_single_block_samples": None,
    "return_dict": True,
    "controlnet_blocks_repeat": False,
}
# What diffusers' FluxAttention drops without a warning when its processor does not take them.
QUIET_ARGUMENTS = frozenset({"ip_adapter_masks", "ip_hidden_states"})


def _default_attention(
    host: DiffusersHost, processor: Any, options: Mapping[str, Any], text_tokens: int
) -> Attention | None:
    """FluxAttnProcessor's attention, where the call's arguments are ones its module drops quietly
    (an IP-Adapter's, in the single blocks); other arguments: the module's own call, which warns."""
    return host.dispatch(processor) if set(options) <= QUIET_ARGUMENTS else None


def _ids(ids: torch.Tensor, name: str) -> torch.Tensor:
    """2-D position ids; 3-D ones with diffusers' deprecation warning, the first batch element."""
    if ids.ndim != 3:
        return ids
    from diffusers.models.transformers.transformer_flux import logger

    logger.warning(
        f"Passing `{name}` 3d torch.Tensor is deprecated."
        "Please remove the batch dimension and pass it as a 2d torch Tensor"
    )
    return ids[0]


def forward(model: nn.Module, host: DiffusersHost, fusion: Fusion, args: tuple, kwargs: dict) -> Any:
    """diffusers' `FluxTransformer2DModel.forward` on the block code; None where diffusers' own
    forward must run the call (see the module docstring)."""
    settings = call_arguments(PARAMETERS, args, kwargs)
    if settings is None or not all(
        isinstance(settings[name], torch.Tensor)
        for name in ("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids")
    ):
        return None
    with host.scaled_adapters(model, kwargs.get("joint_attention_kwargs")) as extra:
        if "joint_attention_kwargs" not in kwargs:  # passed positionally (or not at all): goes on whole
            extra = settings["joint_attention_kwargs"]
        cond = conditioning(
            model,
            host,
            settings["hidden_states"],
            settings["encoder_hidden_states"],
            settings["pooled_projections"],
            settings["timestep"],
            _ids(settings["img_ids"], "img_ids"),
            _ids(settings["txt_ids"], "txt_ids"),
            settings["guidance"],
        )
        if extra is not None and "ip_adapter_image_embeds" in extra:
            embeds = extra.pop("ip_adapter_image_embeds")
            extra.update({"ip_hidden_states": host.call(model.encoder_hid_proj, embeds)})
        controlnet = ControlNet(
            settings["controlnet_block_samples"],
            settings["controlnet_single_block_samples"],
            settings["controlnet_blocks_repeat"],
        )
        out = transformer(model, host, fusion, cond, extra, controlnet)
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=out) if settings["return_dict"] else (out,)


def _block_forward(
    call: Callable[..., Any], norms_plain: Callable[[Host, nn.Module], bool]
) -> Callable[..., Any]:
    """A block class's forward on the block code (both FLUX.1 blocks take diffusers' same arguments),
    for a caller other than the loop (a cache, a hook): `call` on real tensors, (text, image) back;
    None (diffusers' own forward) without RoPE tables or where the block's norms are not plain."""

    def forward(
        block: nn.Module,
        host: DiffusersHost,
        fusion: Fusion,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        image_rotary_emb: Rope | None = None,
        joint_attention_kwargs: Options = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if image_rotary_emb is None or not norms_plain(host, block):
            return None
        return call(
            block,
            host,
            fusion,
            hidden_states,
            encoder_hidden_states,
            temb,
            image_rotary_emb,
            joint_attention_kwargs,
        )

    return forward


BINDING = Binding(
    classes=(
        f"{MODULE}.FluxTransformerBlock",
        f"{MODULE}.FluxSingleTransformerBlock",
        f"{MODULE}.FluxAttention",
        "diffusers.models.attention.FeedForward",
        "diffusers.models.activations.GELU",
        "diffusers.models.normalization.AdaLayerNormZero",
        "diffusers.models.normalization.AdaLayerNormZeroSingle",
        "diffusers.models.normalization.AdaLayerNormContinuous",
    ),
    processors={f"{MODULE}.FluxAttnProcessor": _default_attention},
    forward=forward,
    blocks={
        f"{MODULE}.FluxTransformerBlock": _block_forward(double_block_call, double_norms_plain),
        f"{MODULE}.FluxSingleTransformerBlock": _block_forward(
            single_block_call, lambda host, block: modulation_plain(host, block.norm)
        ),
    },
)
