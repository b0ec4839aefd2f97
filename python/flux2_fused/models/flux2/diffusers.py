"""FLUX.2 as diffusers writes it: the binding of `Flux2Transformer2DModel` to the family's block code.

The diffusers host (`flux2_fused.integrations.diffusers`) finds this module through its registry and
runs `forward` in the transformer's forward slot. What is FLUX.2's and diffusers' at once lives here:
the diffusers classes whose forward the block code reproduces, the attention processors it can run
(the default ones, and the KV-cache editing ones, whose attention stores or injects the reference
rows' K/V), and the forward's arguments:
- `joint_attention_kwargs`: a LoRA "scale" scales the adapters for the call, as diffusers does (only
  when passed by keyword, as diffusers' `apply_lora_scale` reads it); other keys go to each
  attention call, which then runs as diffusers' own;
- KV-cache editing ("extract" and "cached" modes) runs as diffusers' forward does, each block in the
  block code, the fused prologue's q, k, v handed to diffusers' KV attention; the per-token
  modulation of "extract" declines to the eager chain inside the op;
- a call diffusers' forward would reject (malformed arguments, an unknown mode, a "cached" call
  without a cache or attention arguments) returns None, so diffusers' own forward raises its error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ...host import Attention, call_arguments
from ...integrations.diffusers.host import Binding, DiffusersHost
from ..common import Options, Rope, layer_norms_plain
from ..deferral import Fusion
from .blocks import (
    DOUBLE_NORMS,
    Blend,
    conditioning,
    double_block_call,
    single_block_call,
    transformer,
)

MODULE = "diffusers.models.transformers.transformer_flux2"
# The arguments diffusers' forward itself passes to the attention in KV-cache editing.
KV_ARGUMENTS = frozenset({"kv_cache", "kv_cache_mode", "num_ref_tokens", "num_txt_tokens"})
# diffusers' forward's parameters in order (a caller may pass any of them positionally), with defaults.
PARAMETERS = {
    "hidden_states": None,
    "encoder_hidden_states": None,
    "timestep": None,
    "img_ids": None,
    "txt_ids": None,
    "guidance": None,
    "joint_attention_kwargs": None,
    "return_dict": True,
    "kv_cache": None,
    "kv_cache_mode": None,
    "num_ref_tokens": 0,
    "ref_fixed_timestep": 0.0,
}


def _default_attention(
    host: DiffusersHost, processor: Any, options: Mapping[str, Any], text_tokens: int
) -> Attention | None:
    """The default processors' attention; they drop KV arguments, as diffusers' attention module
    drops arguments a processor does not take. Other arguments: the processor's own call."""
    return host.dispatch(processor) if set(options) <= KV_ARGUMENTS else None


def _kv_attention(
    host: DiffusersHost, processor: Any, options: Mapping[str, Any], text_tokens: int
) -> Attention | None:
    """The KV processors' attention on the block code's q, k, v, as they run it: in "extract" mode
    the reference rows' K/V stored in the layer's cache and the reference rows attending only to
    themselves, in "cached" mode the stored K/V injected between the text and image rows; without
    KV arguments the default dispatch. A single block's processor reads the text rows from its
    arguments (`num_txt_tokens`, default 0, as the processor's own)."""
    if not set(options) <= KV_ARGUMENTS:
        return None
    from diffusers.models.transformers.transformer_flux2 import _flux2_kv_causal_attention

    plain = host.dispatch(processor)
    kv_cache, mode = options.get("kv_cache"), options.get("kv_cache_mode")
    refs = options.get("num_ref_tokens", 0)
    txt = options.get("num_txt_tokens", 0) if "Parallel" in type(processor).__name__ else text_tokens

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if mode == "extract" and kv_cache is not None and refs > 0:
            kv_cache.store(key[:, txt : txt + refs].clone(), value[:, txt : txt + refs].clone())
        if mode == "extract" and refs > 0:
            out = _flux2_kv_causal_attention(
                query, key, value, txt, refs, backend=processor._attention_backend
            )
        elif mode == "cached" and kv_cache is not None:
            out = _flux2_kv_causal_attention(
                query, key, value, txt, 0, kv_cache=kv_cache, backend=processor._attention_backend
            )
        else:
            return plain(query, key, value)
        return out.flatten(2, 3).to(query.dtype)

    return attend


def _reference_blend(
    model: nn.Module, host: DiffusersHost, image_tokens: int, txt_tokens: int, refs: int, ref_timestep: float
) -> Blend:
    """KV-cache extraction with reference rows, as diffusers' forward does it: the reference rows'
    own modulation (at a fixed timestep) blended per token into the image and joint modulations."""
    from diffusers.models.transformers.transformer_flux2 import (
        _blend_double_block_mods,
        _blend_single_block_mods,
    )

    def blend(
        timestep: torch.Tensor, guidance: torch.Tensor | None, mod_img: torch.Tensor, mod_single: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ref_temb = host.call(
            model.time_guidance_embed, torch.full_like(timestep, ref_timestep * 1000), guidance
        )
        ref_mod_img = host.call(model.double_stream_modulation_img, ref_temb)
        ref_mod_single = host.call(model.single_stream_modulation, ref_temb)
        return (
            _blend_double_block_mods(mod_img, ref_mod_img, refs, image_tokens),
            _blend_single_block_mods(mod_single, ref_mod_single, txt_tokens, refs, txt_tokens + image_tokens),
        )

    return blend


def _attention_options(
    model: nn.Module, extra: dict | None, kv_cache: Any, mode: str | None, refs: int, txt_tokens: int
) -> tuple[list[dict | None], list[dict | None]]:
    """Each double and single block's attention arguments, as diffusers' forward builds them: the
    caller's `joint_attention_kwargs` (less the LoRA scale), plus in KV modes the mode, the number
    of reference rows, each layer's cache entry and, for single blocks, the number of text rows."""
    base = extra
    if mode == "extract" or (mode == "cached" and kv_cache is not None):
        refs = refs if mode == "extract" else kv_cache.num_ref_tokens
        base = {**(extra or {}), "kv_cache": None, "kv_cache_mode": mode, "num_ref_tokens": refs}
    single = {**(base or {}), "num_txt_tokens": txt_tokens} if mode is not None else base
    with_cache = mode is not None and kv_cache is not None
    double_options = [
        {**base, "kv_cache": kv_cache.get_double(i)} if with_cache else base
        for i in range(len(model.transformer_blocks))
    ]
    single_options = [
        {**single, "kv_cache": kv_cache.get_single(i)} if with_cache else single
        for i in range(len(model.single_transformer_blocks))
    ]
    return double_options, single_options


def forward(model: nn.Module, host: DiffusersHost, fusion: Fusion, args: tuple, kwargs: dict) -> Any:
    """diffusers' `Flux2Transformer2DModel.forward` on the block code; None where diffusers' own
    forward must run the call (see the module docstring)."""
    settings = call_arguments(PARAMETERS, args, kwargs)
    if settings is None:
        return None
    mode, kv_cache = settings["kv_cache_mode"], settings["kv_cache"]
    if mode not in (None, "extract", "cached") or (
        mode == "cached" and kv_cache is None and settings["joint_attention_kwargs"] is None
    ):
        return None
    hidden_states, encoder_hidden_states = settings["hidden_states"], settings["encoder_hidden_states"]
    refs = settings["num_ref_tokens"]
    with host.scaled_adapters(model, kwargs.get("joint_attention_kwargs")) as extra:
        if "joint_attention_kwargs" not in kwargs:  # passed positionally (or not at all): goes on whole
            extra = settings["joint_attention_kwargs"]
        txt_tokens = encoder_hidden_states.shape[1]
        leading_rows = txt_tokens
        blend = None
        if mode == "extract" and refs > 0:  # a new cache, the reference rows' modulation
            from diffusers.models.transformers.transformer_flux2 import Flux2KVCache

            kv_cache = Flux2KVCache(len(model.transformer_blocks), len(model.single_transformer_blocks))
            kv_cache.num_ref_tokens = refs
            blend = _reference_blend(
                model, host, hidden_states.shape[1], txt_tokens, refs, settings["ref_fixed_timestep"]
            )
            leading_rows += refs
        cond = conditioning(
            model,
            host,
            hidden_states,
            encoder_hidden_states,
            settings["timestep"],
            settings["img_ids"],
            settings["txt_ids"],
            settings["guidance"],
            blend=blend,
        )
        double_options, single_options = _attention_options(model, extra, kv_cache, mode, refs, txt_tokens)
        out = transformer(
            model,
            host,
            fusion,
            cond,
            leading_rows=leading_rows,
            double_options=double_options,
            single_options=single_options,
        )
    from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModelOutput

    return_dict = settings["return_dict"]
    if mode == "extract":  # the new cache is returned alongside, as diffusers does
        return Flux2Transformer2DModelOutput(out, kv_cache) if return_dict else (out, kv_cache)
    return Flux2Transformer2DModelOutput(sample=out) if return_dict else (out,)


def double_block_forward(
    block: nn.Module,
    host: DiffusersHost,
    fusion: Fusion,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb_mod_img: torch.Tensor,
    temb_mod_txt: torch.Tensor,
    image_rotary_emb: Rope | None = None,
    joint_attention_kwargs: Options = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`Flux2TransformerBlock.forward` on the block code, for a caller other than the loop (a cache,
    a hook); None (diffusers' own forward) without RoPE tables or where the block's norms are not
    plain."""
    if image_rotary_emb is None or not layer_norms_plain(host, block, DOUBLE_NORMS):
        return None
    return double_block_call(
        block,
        host,
        fusion,
        hidden_states,
        encoder_hidden_states,
        temb_mod_img,
        temb_mod_txt,
        image_rotary_emb,
        joint_attention_kwargs,
    )


def single_block_forward(
    block: nn.Module,
    host: DiffusersHost,
    fusion: Fusion,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    temb_mod: torch.Tensor,
    image_rotary_emb: Rope | None = None,
    joint_attention_kwargs: Options = None,
    split_hidden_states: bool = False,
    text_seq_len: int | None = None,
) -> Any:
    """`Flux2SingleTransformerBlock.forward` on the block code; None as in `double_block_forward`."""
    if image_rotary_emb is None or not layer_norms_plain(host, block, ("norm",)):
        return None
    return single_block_call(
        block,
        host,
        fusion,
        hidden_states,
        encoder_hidden_states,
        temb_mod,
        image_rotary_emb,
        joint_attention_kwargs,
        split_hidden_states,
        text_seq_len,
    )


BINDING = Binding(
    classes=(
        f"{MODULE}.Flux2TransformerBlock",
        f"{MODULE}.Flux2SingleTransformerBlock",
        f"{MODULE}.Flux2Attention",
        f"{MODULE}.Flux2ParallelSelfAttention",
        f"{MODULE}.Flux2FeedForward",
        f"{MODULE}.Flux2SwiGLU",
        "diffusers.models.normalization.AdaLayerNormContinuous",
    ),
    processors={
        f"{MODULE}.Flux2AttnProcessor": _default_attention,
        f"{MODULE}.Flux2ParallelSelfAttnProcessor": _default_attention,
        f"{MODULE}.Flux2KVAttnProcessor": _kv_attention,
        f"{MODULE}.Flux2KVParallelSelfAttnProcessor": _kv_attention,
    },
    forward=forward,
    blocks={
        f"{MODULE}.Flux2TransformerBlock": double_block_forward,
        f"{MODULE}.Flux2SingleTransformerBlock": single_block_forward,
    },
)
