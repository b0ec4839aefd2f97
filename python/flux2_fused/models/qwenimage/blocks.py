"""Qwen-Image's block as functions of its modules, written against `flux2_fused.host.Host`.

diffusers' `QwenImageTransformer2DModel` is a double-stream transformer close to FLUX.1's double
block, sixty of them and no single blocks:
- each block projects its own modulation for both streams (`img_mod`, `txt_mod`: a SiLU then a
  Linear on temb, six D-wide chunks, (shift, scale, gate) for norm1 then norm2) and modulates an
  affine-free LayerNorm as `norm(x) * (1 + scale) + shift`, FLUX.1's rounding;
- attention is FLUX.1's joint attention (q, k, v from biased Linears a stream, text rows first, the
  image rows' output projection before the text rows', each on contiguous rows), with diffusers'
  `RMSNorm` per head and Qwen's RoPE, a complex product per stream (`apply_rotary_emb_qwen`), under
  the text padding mask where the pipeline passes one;
- the MLPs are diffusers' `FeedForward` with a tanh GELU (FLUX.1's `feed_forward`);
- both streams are clipped to +-65504 in fp16 after each block.
The fused sites are the modulated norms with their pending gated residuals, the GELUs and the
attention prologue: diffusers' `RMSNorm` per head (its variance by `pow` and `mean`, the prologue's
"mean" norm) and Qwen's complex rotation (its "complex" rotation) of both streams' q and k, with v's
concat, in one launch. Wherever that launch declines (or a tool replaced `apply_rotary_emb_qwen`),
diffusers' module calls and function run (`host_rope`).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch
from torch import nn

from ...host import Host, functions_own
from ...ops.qk_norm_rope.reference import complex_tables
from ..common import (
    HostRope,
    Options,
    attention_float8_rows,
    double_block_mlps,
    layer_norms_plain,
    split_modulation,
)
from ..deferral import Fusion, Stream, materialize, stream_dtype
from ..flux1.blocks import feed_forward, feed_forward_inputs, joint_attention

MODULE = "diffusers.models.transformers.transformer_qwenimage"
NORMS = ("img_norm1", "txt_norm1", "img_norm2", "txt_norm2")


def modulation_plain(host: Host, mod: nn.Module) -> bool:
    """A block's `img_mod` / `txt_mod` the block code computes: a plain `Sequential(SiLU, Linear)`
    with a plain SiLU (the Linear goes through `host.linear`)."""
    return (
        type(mod) is nn.Sequential
        and len(mod) == 2
        and type(mod[0]) is nn.SiLU
        and host.plain(mod)
        and host.plain(mod[0])
    )


def parts_plain(host: Host, block: nn.Module) -> bool:
    """The block code may compute the block's parts: its two modulations and four affine-free
    LayerNorms plain, no zero-timestep conditioning (`zero_cond_t`, the edit models' per-token
    modulation) and no fused projections (`fuse_projections()` adds them, but Qwen's processor keeps
    computing q, k, v with the separate Linears, other GEMMs). The block itself aside: its fused
    forward runs under whatever wraps it (a cache)."""
    return (
        not block.zero_cond_t
        and not getattr(block.attn, "fused_projections", False)  # Qwen's processor never uses them
        and modulation_plain(host, block.img_mod)
        and modulation_plain(host, block.txt_mod)
        and layer_norms_plain(host, block, NORMS)
    )


def block_plain(host: Host, block: nn.Module) -> bool:
    """The loop may run the block's body itself: the block plain (nothing wraps or hooks it) and its
    parts (`parts_plain`)."""
    return host.plain(block) and parts_plain(host, block)


def host_rope(image_rotary_emb: tuple[torch.Tensor, torch.Tensor]) -> HostRope:
    """Qwen's RoPE for the block code: the prologue's "complex" rotation with the (cos, sin) tables of
    diffusers' (image, text) complex frequencies, text rows first, while `apply_rotary_emb_qwen` is
    diffusers' own; and diffusers' rotation of the joint normalized q and k wherever the launch
    declines: the text rows by the text frequencies and the image rows by the image ones, each
    through `apply_rotary_emb_qwen` as its processor calls it (found at call time, so a replaced
    function is honored: then it alone rotates), joined text first."""
    img_freqs, txt_freqs = image_rotary_emb
    text_tokens = txt_freqs.shape[0]

    def rotate(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        apply = sys.modules[MODULE].apply_rotary_emb_qwen
        rotated = []
        for x in (query, key):
            txt, img = x[:, :text_tokens], x[:, text_tokens:]
            img = apply(img, img_freqs, use_real=False)
            rotated.append(torch.cat([apply(txt, txt_freqs, use_real=False), img], dim=1))
        return rotated[0], rotated[1]

    if not functions_own(((sys.modules[MODULE].apply_rotary_emb_qwen, MODULE),)):
        return HostRope((), rotate, embedding=image_rotary_emb)
    tables = complex_tables(torch.cat([txt_freqs, img_freqs]))
    return HostRope(tuple(tables), rotate, "complex", image_rotary_emb)


def double_block_body(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    x: Stream,
    c: Stream,
    temb_act: torch.Tensor,
    rope: HostRope,
    options: Options = None,
) -> tuple[Stream, Stream]:
    """A block on possibly-pending streams (image x, text c); `temb_act` is silu(temb), which both
    modulation Linears read. Returns both MLP updates pending, clipped (so materialized) in fp16."""
    (shift_msa, scale_msa, gate_msa), mlp_img = split_modulation(host.linear(block.img_mod[1], temb_act), 2)
    (c_shift_msa, c_scale_msa, c_gate_msa), mlp_txt = split_modulation(
        host.linear(block.txt_mod[1], temb_act), 2
    )
    image_rows, text_rows = attention_float8_rows(host, block.attn)
    x_norm, x = fusion.norm(x, scale_msa, shift_msa, block.img_norm1.eps, float8_rows=image_rows)
    c_norm, c = fusion.norm(c, c_scale_msa, c_shift_msa, block.txt_norm1.eps, float8_rows=text_rows)
    x_attn, c_attn = joint_attention(block.attn, host, fusion, x_norm, c_norm, rope, options)
    # FLUX.1's second half under Qwen's names: residual, modulated norm2, MLP, gated residual.
    names = SimpleNamespace(
        norm2=block.img_norm2, norm2_context=block.txt_norm2, ff=block.img_mlp, ff_context=block.txt_mlp
    )
    image, text = (x, x_attn, gate_msa, mlp_img), (c, c_attn, c_gate_msa, mlp_txt)
    x, c = double_block_mlps(names, host, fusion, image, text, feed_forward, feed_forward_inputs)
    if stream_dtype(x) == torch.float16:  # the text stream is clipped already
        x = fusion.saturate(materialize(x))
    return x, c


def double_block_call(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_mask: torch.Tensor | None,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: Options = None,
    modulate_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A block as diffusers calls one (its arguments, (text, image) back), for a caller other than the
    transformer's loop (a cache, a hook): the body on real tensors; None (diffusers' own forward)
    without RoPE frequencies, with a modulation index or where its parts are not plain."""
    if image_rotary_emb is None or modulate_index is not None or not parts_plain(host, block):
        return None
    options = attention_options(joint_attention_kwargs, encoder_hidden_states_mask)
    x, c = double_block_body(
        block,
        host,
        fusion,
        hidden_states,
        encoder_hidden_states,
        torch.nn.functional.silu(temb),
        host_rope(image_rotary_emb),
        options,
    )
    return materialize(c), materialize(x)


# The attention module's keyword for the text padding mask (its processor builds the joint mask).
MASK = "encoder_hidden_states_mask"


def attention_options(kwargs: Options, mask: torch.Tensor | None) -> dict:
    """The attention call's keyword arguments as the block passes them: the transformer's attention
    kwargs and the text padding mask."""
    options = dict(kwargs or {})
    if mask is not None:
        options[MASK] = mask
    return options
