"""FLUX.1's blocks as functions of their modules, written against `flux2_fused.host.Host`.

diffusers' `FluxTransformer2DModel` (FLUX.1 dev and schnell, and the Fill, Kontext, ControlNet
pipelines around it) runs the chains FLUX.2 runs, with three differences this file holds:
- each block computes its own modulation (`AdaLayerNormZero` / `AdaLayerNormZeroSingle`: a Linear
  on silu(temb), chunked into (shift, scale, gate) triples) where FLUX.2 shares three; the
  modulated norm is `norm(x) * (1 + scale) + shift`, the same products as FLUX.2's
  `(1 + scale) * norm(x) + shift` (docs/numerics.md);
- the MLP is Linear -> GELU(tanh) -> Linear (diffusers' `FeedForward`); the single block feeds its
  output projection `cat([attention, gelu(proj_mlp(h))])`, which `gelu_tanh.concat` writes in place;
- q, k, v come from three Linears in both blocks, and the double block projects the image rows'
  attention output (`to_out`) before the text rows' (`to_add_out`), each made contiguous first.
Each dispatcher runs the block code where the module is plain, the host's call elsewhere; the
`*_body` functions are the block code, which the diffusers binding's block forwards call too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...float8_linear import Quantized, dense
from ...host import Host, dropout_inactive
from ...ops import gelu_tanh
from ..common import (
    Options,
    Rope,
    attention_float8_rows,
    call_double_block,
    double_block_mlps,
    float8_rows,
    joint_attention_rows,
    layer_norms_plain,
    module_rope,
    output_norm,
    project_activation,
    prologue,
    qkv_linears,
    qkv_projections,
    split_modulation,
)
from ..deferral import Fusion, PendingConcat, Stream, materialize, stream_rows

DOUBLE_NORMS = ("norm2", "norm2_context")


def gelu_plain(host: Host, act: nn.Module) -> bool:
    """A tanh-approximated GELU module (nn.GELU, or diffusers' GELU with its projection) the op may
    compute: plain and set to the tanh approximation."""
    return host.plain(act) and getattr(act, "approximate", None) == "tanh"


def modulation_plain(host: Host, norm: nn.Module) -> bool:
    """An `AdaLayerNormZero(Single)` whose parts the block code computes itself: plain, no embedding of
    its own (FLUX.1 hands it temb), its SiLU and affine-free LayerNorm plain (its Linear goes through
    `host.linear`)."""
    return (
        host.plain(norm)
        and getattr(norm, "emb", None) is None
        and type(norm.silu) is nn.SiLU
        and host.plain(norm.silu)
        and layer_norms_plain(host, norm, ("norm",))
    )


def double_norms_plain(host: Host, block: nn.Module) -> bool:
    """The double block's four norms are ones the block code computes (the block itself aside: its
    fused forward runs under whatever wraps it)."""
    return (
        modulation_plain(host, block.norm1)
        and modulation_plain(host, block.norm1_context)
        and layer_norms_plain(host, block, DOUBLE_NORMS)
    )


def feed_forward_plain(host: Host, ff: nn.Module) -> bool:
    """diffusers' `FeedForward(activation_fn="gelu-approximate")` the block code computes: GELU's
    projection, the tanh GELU, an inactive dropout, the output Linear, all plain (and a final
    dropout, where one is configured, inactive)."""
    net = list(ff.net)
    return (
        host.plain(ff)
        and len(net) in (3, 4)
        and gelu_plain(host, net[0])
        and all(dropout_inactive(host, m) for m in net[1::2])
    )


def feed_forward(ff: nn.Module, host: Host, fusion: Fusion, x: torch.Tensor | Quantized) -> torch.Tensor:
    """The MLP on the block code where it is plain (`feed_forward_plain`), else the module's own
    call (on x's values, where x came quantized)."""
    if feed_forward_plain(host, ff):
        return project_activation(host, ff.net[2], gelu_tanh, fusion, host.linear(ff.net[0].proj, x))
    return host.call(ff, dense(x))


def feed_forward_inputs(host: Host, ff: nn.Module) -> tuple[nn.Module, ...]:
    """The Linears `feed_forward` reads its input with: GELU's projection, none where the module's
    own call runs."""
    return (ff.net[0].proj,) if feed_forward_plain(host, ff) else ()


def joint_attention(
    attn: nn.Module,
    host: Host,
    fusion: Fusion,
    x: torch.Tensor | Quantized,
    c: torch.Tensor | Quantized,
    rope: Rope,
    options: Options,
) -> tuple[torch.Tensor, ...]:
    """A double block's attention -> (image update, text update), and the IP-Adapter's image update
    third where its processor runs: the block code where the host has an attention for this module
    and these options, else the attention module's own call."""
    attend = host.attention(attn, options, c.shape[1])
    if attend is None:
        return host.call(
            attn,
            hidden_states=dense(x),
            encoder_hidden_states=dense(c),
            image_rotary_emb=module_rope(rope),
            **(options or {}),
        )
    c_out, x_out = joint_attention_rows(attn, host, fusion, x, c, rope, attend)
    x_out = host.linear(attn.to_out[0], x_out.contiguous())
    return x_out, host.linear(attn.to_add_out, c_out.contiguous())


def double_block_body(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    x: Stream,
    c: Stream,
    temb_act: torch.Tensor,
    rope: Rope,
    options: Options = None,
) -> tuple[Stream, Stream]:
    """A double block on possibly-pending streams (image x, text c); `temb_act` is silu(temb), which
    both modulation Linears read. Returns both FFN updates, pending where nothing else reads them:
    the text stream is clipped in fp16, and an IP-Adapter's image update is added after the FFN's."""
    attn = block.attn
    image_rows, text_rows = attention_float8_rows(host, attn)
    (shift_msa, scale_msa, gate_msa), mlp_img = split_modulation(host.linear(block.norm1.linear, temb_act), 2)
    x_norm, x = fusion.norm(x, scale_msa, shift_msa, block.norm1.norm.eps, float8_rows=image_rows)
    (c_shift_msa, c_scale_msa, c_gate_msa), mlp_txt = split_modulation(
        host.linear(block.norm1_context.linear, temb_act), 2
    )
    c_norm, c = fusion.norm(c, c_scale_msa, c_shift_msa, block.norm1_context.norm.eps, float8_rows=text_rows)
    x_attn, c_attn, *ip = joint_attention(attn, host, fusion, x_norm, c_norm, rope, options)
    image, text = (x, x_attn, gate_msa, mlp_img), (c, c_attn, c_gate_msa, mlp_txt)
    x_next, c_next = double_block_mlps(block, host, fusion, image, text, feed_forward, feed_forward_inputs)
    if ip:  # the IP-Adapter's image update, after the feed-forward's, as diffusers adds it
        x_next = materialize(x_next) + ip[0]
    return x_next, c_next


def double_block(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    x: Stream,
    c: Stream,
    temb: torch.Tensor,
    temb_act: torch.Tensor,
    rope: Rope,
    options: Options = None,
) -> tuple[Stream, Stream]:
    """One double block: its body where the block and its norms are plain, else the host's call on
    the streams materialized (hooks see real tensors)."""
    if host.plain(block) and double_norms_plain(host, block):
        return double_block_body(block, host, fusion, x, c, temb_act, rope, options)
    return call_double_block(host, block, x, c, rope, options, temb=temb)


def single_update(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    h: torch.Tensor | Quantized,
    rope: Rope,
    options: Options,
    text_tokens: int,
) -> torch.Tensor:
    """A single block's update before its gate: `proj_out(cat([attention(h), gelu(proj_mlp(h))]))`.
    With the host's attention and a plain tanh GELU the activation is written into its half of
    `proj_out`'s input; else the modules' own calls and the cat, in diffusers' order."""
    mlp = host.linear(block.proj_mlp, h)
    attend = host.attention(block.attn, options, text_tokens)
    if attend is None or not gelu_plain(host, block.act_mlp):
        act = host.call(block.act_mlp, mlp)
        out = host.call(block.attn, hidden_states=dense(h), image_rotary_emb=rope, **(options or {}))
        return host.linear(block.proj_out, torch.cat([out, act], dim=2))
    attn = block.attn
    query, key, value = qkv_projections(attn, host, h, ("to_q", "to_k", "to_v"), "to_qkv")
    query, key, _ = prologue(host, fusion, [(query, attn.norm_q)], [(key, attn.norm_k)], rope)
    out = attend(query, key, value)
    return project_activation(host, block.proj_out, gelu_tanh, fusion, mlp, prefix=out)


def single_block_body(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    h: Stream,
    temb_act: torch.Tensor,
    rope: Rope,
    options: Options = None,
    text_tokens: int = 0,
) -> Stream:
    """A single block on a possibly-pending joint stream (text rows first); returns its update
    pending (clipped in fp16, so materialized there)."""
    ((shift, scale, gate),) = split_modulation(host.linear(block.norm.linear, temb_act), 1)
    readers = (block.proj_mlp, *qkv_linears(block.attn, ("to_q", "to_k", "to_v"), "to_qkv"))
    h_norm, h = fusion.norm(h, scale, shift, block.norm.norm.eps, float8_rows=float8_rows(host, readers))
    update = single_update(block, host, fusion, h_norm, rope, options, text_tokens)
    return fusion.add(h, update, gate, clip_fp16=True)


def single_block(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    h: Stream,
    temb: torch.Tensor,
    temb_act: torch.Tensor,
    rope: Rope,
    options: Options = None,
    text_tokens: int = 0,
) -> Stream:
    """One single block, chosen like `double_block`. diffusers' block takes the text and image rows
    apart and concatenates them itself; the loop keeps them joint (the concat of a block's own split
    output is the same tensor) and splits only for a host's call."""
    if host.plain(block) and modulation_plain(host, block.norm):
        return single_block_body(block, host, fusion, h, temb_act, rope, options, text_tokens)
    h = materialize(h)
    c_out, x_out = host.call(
        block,
        hidden_states=h[:, text_tokens:],
        encoder_hidden_states=h[:, :text_tokens],
        temb=temb,
        image_rotary_emb=rope,
        joint_attention_kwargs=options,
    )
    return PendingConcat(c_out, x_out)


def double_block_call(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
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
        F.silu(temb),
        image_rotary_emb,
        joint_attention_kwargs,
    )
    return materialize(c), materialize(x)


def single_block_call(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: Rope,
    joint_attention_kwargs: Options = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A single block as diffusers calls one: text and image rows concatenated (text first), the
    body, the result materialized and split back into (text, image) views."""
    text_tokens = encoder_hidden_states.shape[1]
    h = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    h = materialize(
        single_block_body(
            block, host, fusion, h, F.silu(temb), image_rotary_emb, joint_attention_kwargs, text_tokens
        )
    )
    return h[:, :text_tokens], h[:, text_tokens:]


@dataclass(frozen=True)
class Conditioning:
    """What every block reads besides the streams: the time embedding and the joint RoPE tables,
    with the embedded image and text streams."""

    temb: torch.Tensor
    x: torch.Tensor
    c: torch.Tensor
    rope: Rope


@dataclass(frozen=True)
class ControlNet:
    """ControlNet residuals as diffusers' forward adds them: after double block i, sample
    `i % len` (`repeat`, XLabs' ControlNets) or `i // ceil(blocks / len)`; after single block i,
    `i // ceil(blocks / len)`, to the image rows."""

    double: Sequence[torch.Tensor] | None = None
    single: Sequence[torch.Tensor] | None = None
    repeat: bool = False

    def double_sample(self, index: int, blocks: int) -> torch.Tensor | None:
        if self.double is None:
            return None
        if self.repeat:
            return self.double[index % len(self.double)]
        return self.double[index // math.ceil(blocks / len(self.double))]

    def single_sample(self, index: int, blocks: int) -> torch.Tensor | None:
        if self.single is None:
            return None
        return self.single[index // math.ceil(blocks / len(self.single))]


def conditioning(
    model: nn.Module,
    host: Host,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    pooled_projections: torch.Tensor | None,
    timestep: torch.Tensor,
    img_ids: torch.Tensor,
    txt_ids: torch.Tensor,
    guidance: torch.Tensor | None,
) -> Conditioning:
    """diffusers' preamble, modules called in its order: the input embedder, timestep and guidance
    cast to the embedded stream's dtype and x1000, the time (+ guidance) + pooled-text embedding,
    the context embedder, the RoPE tables of the joint ids (text first; 2-D ids), moved to the
    stream's device as the rotation moves them."""
    x = host.linear(model.x_embedder, hidden_states)
    timestep = timestep.to(x.dtype) * 1000
    if guidance is not None:
        guidance = guidance.to(x.dtype) * 1000
        temb = host.call(model.time_text_embed, timestep, guidance, pooled_projections)
    else:
        temb = host.call(model.time_text_embed, timestep, pooled_projections)
    c = host.linear(model.context_embedder, encoder_hidden_states)
    cos, sin = host.call(model.pos_embed, torch.cat((txt_ids, img_ids), dim=0))
    return Conditioning(temb=temb, x=x, c=c, rope=(cos.to(x.device), sin.to(x.device)))


def transformer(
    model: nn.Module,
    host: Host,
    fusion: Fusion,
    cond: Conditioning,
    options: Options = None,
    controlnet: ControlNet | None = None,
) -> torch.Tensor:
    """The blocks and the output in diffusers' order: double blocks (each followed by its ControlNet
    residual), single blocks on the joint rows (likewise, on the image rows), the output norm of
    the image rows and the output projection. Streams stay pending between plain blocks; a
    ControlNet residual materializes the stream it is added to, as diffusers adds it."""
    controlnet = controlnet or ControlNet()
    temb_act = F.silu(cond.temb)  # each block's modulation Linear reads silu(temb): computed once
    text_tokens = cond.c.shape[1]
    x: Stream = cond.x
    c: Stream = cond.c
    blocks = model.transformer_blocks
    for index, block in enumerate(blocks):
        x, c = double_block(block, host, fusion, x, c, cond.temb, temb_act, cond.rope, options)
        sample = controlnet.double_sample(index, len(blocks))
        if sample is not None:
            x = materialize(x) + sample
    h: Stream = PendingConcat(c, x)
    blocks = model.single_transformer_blocks
    for index, block in enumerate(blocks):
        h = single_block(block, host, fusion, h, cond.temb, temb_act, cond.rope, options, text_tokens)
        sample = controlnet.single_sample(index, len(blocks))
        if sample is not None:
            h = materialize(h)
            h = PendingConcat(h[:, :text_tokens], h[:, text_tokens:] + sample)
    out = output_norm(model.norm_out, host, fusion, stream_rows(h, text_tokens), cond.temb)
    return host.linear(model.proj_out, out)
