"""FLUX.2's blocks as functions of their modules, written once for every host.

The package's `Flux2Transformer` and diffusers' `Flux2Transformer2DModel` name their submodules
alike (`norm1`, `attn.to_q`, `attn.norm_added_k`, `ff.linear_in`, `attn.to_qkv_mlp_proj`, ...)
and call them alike (diffusers' keyword arguments), so these functions take a block (or its
attention, feed-forward, output norm) of any host and run diffusers' eager computation, each fusable
site sent to its op's entry point, which runs the kernel where the guards prove it exact. They reach
the host only through `flux2_fused.host.Host`: every projection through `host.linear` (so a LoRA
layer, a quantized linear, an offload hook runs as in the host, with the parameters it holds at call
time), the attention through `host.attention`, and any module the block code may not compute itself
(`host.plain` says which) through `host.call`.

Each dispatcher (`double_block`, `single_block`, `joint_attention`, `feed_forward`, `output_norm`)
runs the block code where the module is plain and the host's own call elsewhere; the `*_body`
functions are the block code itself, which a host's module forward may call directly (the package's
modules do).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ...float8_linear import Quantized, dense
from ...host import Attention, Host
from ..common import (
    Options,
    Rope,
    activation_op,
    activation_plain,
    attention_float8_rows,
    call_double_block,
    double_block_mlps,
    feed_forward,
    feed_forward_inputs,
    float8_rows,
    joint_attention_rows,
    layer_norms_plain,
    output_norm,
    project_activation,
    prologue,
    split_modulation,
)
from ..deferral import Fusion, PendingConcat, Stream, materialize, stream_rows

DOUBLE_NORMS = ("norm1", "norm1_context", "norm2", "norm2_context")


def double_attention(
    attn: nn.Module,
    host: Host,
    fusion: Fusion,
    x: torch.Tensor | Quantized,
    c: torch.Tensor | Quantized,
    rope: Rope,
    attend: Attention,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Joint attention of a double block: x [B, N, D] image rows, c [B, L, D] text rows -> (image
    update, text update). Text rows come first in the joint sequence (and in the RoPE tables).
    `attend` maps the prologue's q, k, v to the attention output (the host's backend)."""
    c_out, x_out = joint_attention_rows(attn, host, fusion, x, c, rope, attend)
    c_out = host.linear(
        attn.to_add_out, c_out
    )  # before to_out, as diffusers calls them (adapter dropout draws in order)
    return host.linear(attn.to_out[0], x_out), c_out


def joint_attention(
    attn: nn.Module,
    host: Host,
    fusion: Fusion,
    x: torch.Tensor | Quantized,
    c: torch.Tensor | Quantized,
    rope: Rope,
    options: Options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A double block's attention: the block code with the host's attention where the host has one
    for this module and these options, else the attention module's own call."""
    attend = host.attention(attn, options, c.shape[1])
    if attend is None:
        return host.call(
            attn,
            hidden_states=dense(x),
            encoder_hidden_states=dense(c),
            image_rotary_emb=rope,
            **(options or {}),
        )
    return double_attention(attn, host, fusion, x, c, rope, attend)


def parallel_attention(
    attn: nn.Module, host: Host, fusion: Fusion, h: torch.Tensor | Quantized, rope: Rope, attend: Attention
) -> torch.Tensor:
    """A single block's body: one Linear gives q, k, v and the MLP input, one maps the attention
    output and the SwiGLU activation back to D. The split follows diffusers' (q, k, v and the MLP
    part in proportion to their full widths, so a column-sharded projection splits alike); `attend`
    as in `double_attention`."""
    proj = host.linear(attn.to_qkv_mlp_proj, h)
    qkv_dim = 3 * attn.inner_dim
    qkv_width = proj.shape[-1] * qkv_dim // (qkv_dim + attn.mlp_hidden_dim * attn.mlp_mult_factor)
    qkv, mlp = proj.split([qkv_width, proj.shape[-1] - qkv_width], dim=-1)
    query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
    query, key, _ = prologue(host, fusion, [(query, attn.norm_q)], [(key, attn.norm_k)], rope)
    out = attend(query, key, value)
    op = activation_op(getattr(attn, "mlp_act_fn", None))
    return project_activation(host, attn.to_out, op, fusion, mlp, prefix=out)


def single_attention(
    attn: nn.Module,
    host: Host,
    fusion: Fusion,
    h: torch.Tensor | Quantized,
    rope: Rope,
    options: Options,
    text_tokens: int,
) -> torch.Tensor:
    """A single block's attention + MLP: the block code where the host has an attention for this
    module and its SwiGLU (where it has one as a module) is plain, else the module's own call."""
    attend = host.attention(attn, options, text_tokens)
    if attend is None or not activation_plain(host, getattr(attn, "mlp_act_fn", None)):
        return host.call(attn, hidden_states=dense(h), image_rotary_emb=rope, **(options or {}))
    return parallel_attention(attn, host, fusion, h, rope, attend)


def double_block_body(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    x: Stream,
    c: Stream,
    mod_img: torch.Tensor,
    mod_txt: torch.Tensor,
    rope: Rope,
    options: Options = None,
) -> tuple[Stream, Stream]:
    """A double block on possibly-pending streams (image x, text c); returns both FFN updates pending.

    Stream by stream in diffusers' order: image attention residual, norm2, FFN residual; then the
    same for text, whose result is clipped in fp16."""
    (shift_msa, scale_msa, gate_msa), mlp_img = split_modulation(mod_img, 2)
    (c_shift_msa, c_scale_msa, c_gate_msa), mlp_txt = split_modulation(mod_txt, 2)
    attn = block.attn
    image_rows, text_rows = attention_float8_rows(host, attn)
    x_norm, x = fusion.norm(x, scale_msa, shift_msa, block.norm1.eps, float8_rows=image_rows)
    c_norm, c = fusion.norm(c, c_scale_msa, c_shift_msa, block.norm1_context.eps, float8_rows=text_rows)
    x_attn, c_attn = joint_attention(attn, host, fusion, x_norm, c_norm, rope, options)
    image, text = (x, x_attn, gate_msa, mlp_img), (c, c_attn, c_gate_msa, mlp_txt)
    return double_block_mlps(block, host, fusion, image, text, feed_forward, feed_forward_inputs)


def double_block_plain(host: Host, block: nn.Module) -> bool:
    """A double block's body may run: the block and its four affine-free LayerNorms are plain."""
    return host.plain(block) and layer_norms_plain(host, block, DOUBLE_NORMS)


def double_block(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    x: Stream,
    c: Stream,
    mod_img: torch.Tensor,
    mod_txt: torch.Tensor,
    rope: Rope,
    options: Options = None,
) -> tuple[Stream, Stream]:
    """One double block: its body on the pending streams where the block and its norms are plain,
    else the host's call of the block on the streams materialized (hooks see real tensors)."""
    if double_block_plain(host, block):
        return double_block_body(block, host, fusion, x, c, mod_img, mod_txt, rope, options)
    return call_double_block(host, block, x, c, rope, options, temb_mod_img=mod_img, temb_mod_txt=mod_txt)


def double_block_call(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb_mod_img: torch.Tensor,
    temb_mod_txt: torch.Tensor,
    image_rotary_emb: Rope,
    joint_attention_kwargs: Options = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A double block as diffusers calls one (its keyword arguments, (text, image) back), on real
    tensors: the body, its updates materialized at the block's edge, where the caller reads them."""
    x, c = double_block_body(
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
    return materialize(c), materialize(x)


def single_block_body(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    h: Stream,
    mod: torch.Tensor,
    rope: Rope,
    options: Options = None,
    text_tokens: int = 0,
) -> Stream:
    """A single block on a possibly-pending joint stream; returns its update pending (clipped in fp16)."""
    ((shift, scale, gate),) = split_modulation(mod, 1)
    h_norm, h = fusion.norm(
        h, scale, shift, block.norm.eps, float8_rows=float8_rows(host, (block.attn.to_qkv_mlp_proj,))
    )
    update = single_attention(block.attn, host, fusion, h_norm, rope, options, text_tokens)
    return fusion.add(h, update, gate, clip_fp16=True)


def single_block_plain(host: Host, block: nn.Module) -> bool:
    """A single block's body may run: the block and its affine-free LayerNorm are plain."""
    return host.plain(block) and layer_norms_plain(host, block, ("norm",))


def single_block(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    h: Stream,
    mod: torch.Tensor,
    rope: Rope,
    options: Options = None,
    text_tokens: int = 0,
) -> Stream:
    """One single block, chosen like `double_block`; `text_tokens` leads the joint rows."""
    if single_block_plain(host, block):
        return single_block_body(block, host, fusion, h, mod, rope, options, text_tokens)
    return host.call(
        block,
        hidden_states=materialize(h),
        encoder_hidden_states=None,
        temb_mod=mod,
        image_rotary_emb=rope,
        joint_attention_kwargs=options,
    )


def single_block_call(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    temb_mod: torch.Tensor,
    image_rotary_emb: Rope,
    joint_attention_kwargs: Options = None,
    split_hidden_states: bool = False,
    text_seq_len: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A single block as diffusers calls one, on real tensors: text rows given apart are put first,
    and `split_hidden_states` returns (text, image) split at `text_seq_len`."""
    if encoder_hidden_states is not None:
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    h = single_block_body(
        block,
        host,
        fusion,
        hidden_states,
        temb_mod,
        image_rotary_emb,
        joint_attention_kwargs,
        text_seq_len or 0,
    )
    h = materialize(h)
    return (h[:, :text_seq_len], h[:, text_seq_len:]) if split_hidden_states else h


def joint_rope(
    pos_embed: nn.Module, host: Host, img_ids: torch.Tensor, txt_ids: torch.Tensor, device: torch.device
) -> Rope:
    """Joint RoPE tables, text rows first, built where the ids live and then moved to `device`.

    Batched ids [B, S, n_axes] use the first batch element's ids, as diffusers does.
    """
    img_cos, img_sin = host.call(pos_embed, img_ids[0] if img_ids.ndim == 3 else img_ids)
    txt_cos, txt_sin = host.call(pos_embed, txt_ids[0] if txt_ids.ndim == 3 else txt_ids)
    return torch.cat([txt_cos, img_cos]).to(device), torch.cat([txt_sin, img_sin]).to(device)


@dataclass(frozen=True)
class Conditioning:
    """What every block reads besides the streams: the scaled timestep and guidance, the time
    embedding, the three modulations, the embedded streams and the joint RoPE tables."""

    timestep: torch.Tensor
    guidance: torch.Tensor | None
    temb: torch.Tensor
    mod_img: torch.Tensor
    mod_txt: torch.Tensor
    mod_single: torch.Tensor
    x: torch.Tensor
    c: torch.Tensor
    rope: Rope


# Turns (scaled timestep, scaled guidance, image modulation, joint modulation) into the two
# modulations the blocks use: a host's per-token blend (KV extraction's reference rows).
Blend = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]


def conditioning(
    model: nn.Module,
    host: Host,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    img_ids: torch.Tensor,
    txt_ids: torch.Tensor,
    guidance: torch.Tensor | None,
    blend: Blend | None = None,
) -> Conditioning:
    """diffusers' preamble: timestep and guidance cast to the input dtype and x1000, the time
    embedding, the modulations computed once (then `blend`, where diffusers computes it), the input
    and context embedders, the RoPE tables; modules called in diffusers' order."""
    timestep = timestep.to(hidden_states.dtype) * 1000
    if guidance is not None:
        guidance = guidance.to(hidden_states.dtype) * 1000
    temb = host.call(model.time_guidance_embed, timestep, guidance)
    mod_img = host.call(model.double_stream_modulation_img, temb)
    mod_txt = host.call(model.double_stream_modulation_txt, temb)
    mod_single = host.call(model.single_stream_modulation, temb)
    if blend is not None:
        mod_img, mod_single = blend(timestep, guidance, mod_img, mod_single)
    return Conditioning(
        timestep=timestep,
        guidance=guidance,
        temb=temb,
        mod_img=mod_img,
        mod_txt=mod_txt,
        mod_single=mod_single,
        x=host.linear(model.x_embedder, hidden_states),
        c=host.linear(model.context_embedder, encoder_hidden_states),
        rope=joint_rope(model.pos_embed, host, img_ids, txt_ids, hidden_states.device),
    )


def transformer(
    model: nn.Module,
    host: Host,
    fusion: Fusion,
    cond: Conditioning,
    *,
    leading_rows: int,
    double_options: Iterable[Options] | None = None,
    single_options: Iterable[Options] | None = None,
) -> torch.Tensor:
    """The blocks and the output in diffusers' order: double blocks, the text-first concat, single
    blocks, the output norm of the rows after the first `leading_rows` (the text, and in KV
    extraction the reference rows too) and the output projection. Streams stay pending between
    plain blocks; `double_options` / `single_options` are each block's attention arguments."""
    x: Stream = cond.x
    c: Stream = cond.c
    text_tokens = cond.c.shape[1]
    for block, options in zip(
        model.transformer_blocks, double_options or itertools.repeat(None), strict=False
    ):
        x, c = double_block(block, host, fusion, x, c, cond.mod_img, cond.mod_txt, cond.rope, options)
    h: Stream = PendingConcat(c, x)
    for block, options in zip(
        model.single_transformer_blocks, single_options or itertools.repeat(None), strict=False
    ):
        h = single_block(block, host, fusion, h, cond.mod_single, cond.rope, options, text_tokens)
    out = output_norm(model.norm_out, host, fusion, stream_rows(h, leading_rows), cond.temb)
    return host.linear(model.proj_out, out)
