"""FLUX.3's blocks as functions of their modules, written against `flux2_fused.host.Host`.

diffusers' `Flux3Transformer2DModel` differs from FLUX.2 in four ways this file holds:
- modulation is per token: each block gets a [B, S, 3D] tensor and chunks it into (shift, scale,
  gate) [B, S, D] views, which the modulated norm and the gated residual read row by row;
- a mode block (text, image, reference image: each its own stack, attending within itself) runs
  attention and the SwiGLU MLP in parallel on one modulated norm and returns
  `x + gate * (attn + mlp)`: the two-term update is left pending, into the next block's norm;
- a joint single block normalizes the text rows and the content rows (image, then reference) with
  their own modulations into one joint buffer (no concat), runs attention and the MLP on it, and
  updates the two streams with their own gates, both left pending;
- the attention prologue upcasts q and k to fp32 before the RMSNorm (its weight kept in fp32) and
  RoPE, rounding once at the end (`qk_norm_rope` in its fp32 mode).
The per-token modulation is a Linear of a time embedding expanded over the tokens, so its rows are
each batch's first in every run measured; `uniform_rows` proves it on the GPU once a step for each
modulation a stack shares, and the norms then read one row a batch where the proof's word says so.
A proof is revoked where the modulation goes to a block the block code does not run (a hook could
change it in place).
Each dispatcher runs the block code where the module is plain, the host's call elsewhere; the
`*_body` functions are the block code, which the diffusers binding's block forwards call too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...float8_linear import Quantized, dense
from ...host import Host
from ...ops import qk_norm_rope, uniform_rows
from ...ops.uniform_rows import UniformRows
from ..common import (
    Rope,
    feed_forward,
    feed_forward_inputs,
    float8_rows,
    layer_norms_plain,
    qk_norms,
    qkv_linears,
    qkv_projections,
    split_modulation,
)
from ..deferral import Fusion, Stream, materialize


def prologue(
    attn: nn.Module,
    host: Host,
    fusion: Fusion,
    query: torch.Tensor,
    key: torch.Tensor,
    rope: Rope,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_q(q.float())` and `norm_k(k.float())`, RoPE in fp32, one cast to `dtype` (v's), as
    `Flux3AttnProcessor` runs them: one fused launch (which rounds to q's dtype) where the host
    vouches for both norms as `nn.RMSNorm`s of one eps and v's dtype is q's; else the norm modules'
    own calls."""
    norms = qk_norms(host, (attn.norm_q, attn.norm_k)) if query.dtype == dtype else None
    if norms is None or norms[0].norm != "fused":
        rotated = (
            qk_norm_rope.reference.rope(host.call(norm, x.float()), *rope)
            for norm, x in ((attn.norm_q, query), (attn.norm_k, key))
        )
        q, k = (x.to(dtype) for x in rotated)
        return q, k
    q, k, _ = qk_norm_rope.apply(
        [qk_norm_rope.Segment(query, norms[0].weight)],
        [qk_norm_rope.Segment(key, norms[1].weight)],
        *rope,
        norms[0].eps,
        upcast=True,
        enabled=fusion.fused,
    )
    return q, k


def attention(
    attn: nn.Module, host: Host, fusion: Fusion, h: torch.Tensor | Quantized, rope: Rope
) -> torch.Tensor:
    """`Flux3Attention` on the block code where the host has an attention for it: the q, k, v
    projections (after `fuse_projections()`, thirds of `to_qkv`'s output, as `Flux3AttnProcessor`
    chunks it), the fp32 prologue, the host's attention and the output projection; else the
    module's own call (on h's values, where h came quantized)."""
    attend = host.attention(attn, None, 0)
    if attend is None:
        return host.call(attn, hidden_states=dense(h), image_rotary_emb=rope)
    query, key, value = qkv_projections(attn, host, h, ("to_q", "to_k", "to_v"), "to_qkv")
    query, key = prologue(attn, host, fusion, query, key, rope, value.dtype)
    return host.linear(attn.to_out[0], attend(query, key, value))


def parallel_update(
    block: nn.Module, host: Host, fusion: Fusion, normed: torch.Tensor | Quantized, rope: Rope
) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention, MLP) of one modulated norm, in diffusers' order."""
    return attention(block.attn, host, fusion, normed, rope), feed_forward(block.ff, host, fusion, normed)


def norm_float8_rows(host: Host, block: nn.Module) -> bool:
    """Whether the block's norm may come as torchao's per-row float8 (`Fusion.norm`'s `float8_rows`):
    its readers, the attention's q, k, v projections and the MLP's input Linear, all quantize it
    that way. Where the attention runs as the module's own call after all, it reads the norm's
    values (`dense`)."""
    attention_readers = qkv_linears(block.attn, ("to_q", "to_k", "to_v"), "to_qkv")
    return float8_rows(host, (*attention_readers, *feed_forward_inputs(host, block.ff)))


def mode_block_body(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    x: Stream,
    mod: torch.Tensor,
    rope: Rope,
    rows: UniformRows | None = None,
) -> Stream:
    """A mode block on a possibly-pending stream; returns `x + gate * (attn + mlp)` pending. rows:
    the proof of mod's equal rows, where one was made."""
    shift, scale, gate = split_modulation(mod, 1)[0]
    float8 = norm_float8_rows(host, block)
    normed, x = fusion.norm(x, scale, shift, block.norm.eps, float8_rows=float8, mod_rows=rows)
    attn_out, mlp_out = parallel_update(block, host, fusion, normed, rope)
    return fusion.add(x, attn_out, gate, update2=mlp_out, gate_rows=rows)


def block_plain(host: Host, block: nn.Module) -> bool:
    """A block's body may run: the block and its affine-free LayerNorm are plain."""
    return host.plain(block) and layer_norms_plain(host, block, ("norm",))


def _revoke(*proofs: UniformRows | None) -> None:
    """Stop vouching for modulations handed to code other than the block code."""
    for proof in proofs:
        if proof is not None:
            proof.revoke()


def mode_block(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    x: Stream,
    mod: torch.Tensor,
    rope: Rope,
    rows: UniformRows | None = None,
) -> Stream:
    """One mode block: its body where plain, else the host's call on the stream materialized (and
    mod's proof revoked)."""
    if block_plain(host, block):
        return mode_block_body(block, host, fusion, x, mod, rope, rows)
    _revoke(rows)
    return host.call(block, materialize(x), mod, rope)


def mode_block_call(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    hidden_states: torch.Tensor,
    temb_mod: torch.Tensor,
    rope: Rope,
) -> torch.Tensor:
    """A mode block as diffusers calls one, on real tensors: the body, its update materialized at the
    block's edge, where the caller reads it."""
    return materialize(mode_block_body(block, host, fusion, hidden_states, temb_mod, rope))


def single_block_body(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    c: Stream,
    x: Stream,
    mod: torch.Tensor,
    mod_context: torch.Tensor,
    rope: Rope,
    rows: UniformRows | None = None,
    rows_context: UniformRows | None = None,
) -> tuple[Stream, Stream]:
    """A joint single block on possibly-pending text (c) and content (x) streams: both modulated
    norms written into one joint buffer (text first), attention and MLP on it, each stream's update
    `stream + gate * (attn + mlp)` over its own rows left pending. Returns (text, content). rows and
    rows_context: the proofs of mod's and mod_context's equal rows, where made."""
    shift, scale, gate = split_modulation(mod, 1)[0]
    c_shift, c_scale, c_gate = split_modulation(mod_context, 1)[0]
    normed, c, x = fusion.joint_norm(
        (c, x),
        (c_scale, scale),
        (c_shift, shift),
        block.norm.eps,
        float8_rows=norm_float8_rows(host, block),
        mod_rows=(rows_context, rows),
    )
    text_tokens = c.shape[1]
    attn_out, mlp_out = parallel_update(block, host, fusion, normed, rope)
    return (
        fusion.add(
            c, attn_out[:, :text_tokens], c_gate, update2=mlp_out[:, :text_tokens], gate_rows=rows_context
        ),
        fusion.add(x, attn_out[:, text_tokens:], gate, update2=mlp_out[:, text_tokens:], gate_rows=rows),
    )


def single_block_call(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb_mod: torch.Tensor,
    temb_mod_context: torch.Tensor,
    rope: Rope,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A joint single block as diffusers calls one, (text, content) back, materialized."""
    c, x = single_block_body(
        block, host, fusion, encoder_hidden_states, hidden_states, temb_mod, temb_mod_context, rope
    )
    return materialize(c), materialize(x)


def single_block(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    c: Stream,
    x: Stream,
    mod: torch.Tensor,
    mod_context: torch.Tensor,
    rope: Rope,
    rows: UniformRows | None = None,
    rows_context: UniformRows | None = None,
) -> tuple[Stream, Stream]:
    """One joint single block: its body where plain, else the host's call (diffusers' keywords,
    (text, content) back) on the streams materialized (and the modulations' proofs revoked)."""
    if block_plain(host, block):
        return single_block_body(block, host, fusion, c, x, mod, mod_context, rope, rows, rows_context)
    _revoke(rows, rows_context)
    return host.call(
        block,
        hidden_states=materialize(x),
        encoder_hidden_states=materialize(c),
        temb_mod=mod,
        temb_mod_context=mod_context,
        image_rotary_emb=rope,
    )


def output_norm_plain(host: Host, norm_out: nn.Module) -> bool:
    """`Flux3AdaLayerNorm`'s body may run: it, its SiLU and its affine-free LayerNorm are plain."""
    return (
        host.plain(norm_out)
        and type(norm_out.act_fn) is nn.SiLU
        and host.plain(norm_out.act_fn)
        and layer_norms_plain(host, norm_out, ("norm",))
    )


def output_norm(
    norm_out: nn.Module, host: Host, fusion: Fusion, x: Stream, temb: torch.Tensor, temb_act: torch.Tensor
) -> torch.Tensor:
    """`Flux3AdaLayerNorm`: its Linear on silu(temb) (`temb_act`, made once for the image
    modulations too) gives per-token (scale, shift) - scale first - around the LayerNorm of a
    stream nothing reads afterwards: `norm(x) * (1 + scale) + shift`, the kernel's products in the
    other order, which IEEE multiplication does not tell apart."""
    if not output_norm_plain(host, norm_out):
        return host.call(norm_out, materialize(x), temb)
    scale, shift = host.linear(norm_out.linear, temb_act).chunk(2, dim=-1)
    return fusion.output_norm(x, scale, shift, norm_out.norm.eps)


@dataclass(frozen=True)
class ModeInputs:
    """One token mode's embedded rows, its two modulations (mode blocks, joint blocks) and RoPE."""

    x: torch.Tensor
    early_mod: torch.Tensor
    single_mod: torch.Tensor
    rope: Rope


@dataclass(frozen=True)
class Conditioning:
    """What the blocks read besides the streams: the image rows' per-token time embedding and its
    silu (the output norm's), and each mode's inputs (reference rows None without reference
    images)."""

    image_temb: torch.Tensor
    image_act: torch.Tensor
    text: ModeInputs
    image: ModeInputs
    reference: ModeInputs | None


def _mode(
    model: nn.Module, host: Host, name: str, temb_act: torch.Tensor, x: torch.Tensor, ids: torch.Tensor
):
    """A mode's modulations, embedded rows and RoPE tables, modules called in diffusers' order."""
    early = host.call(model.early_stream_modulations[name], temb_act)
    single = host.call(model.single_stream_modulations[name], temb_act)
    embedder = model.context_embedder if name == "txt" else model.x_embedders[name]
    return ModeInputs(host.linear(embedder, x), early, single, host.call(model.pos_embed, ids))


def _time_embedding(model: nn.Module, host: Host, t: torch.Tensor, embedder: nn.Module) -> torch.Tensor:
    """`embedder(time_proj(t))` in the input dtype, as [B, 1, D]."""
    projected = host.call(model.time_proj, t)
    return host.call(embedder, projected.to(t.dtype))[:, None, :]


def conditioning(
    model: nn.Module,
    host: Host,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    img_ids: torch.Tensor,
    txt_ids: torch.Tensor,
    image_cond_hidden_states: torch.Tensor | None,
    image_cond_ids: torch.Tensor | None,
    target_timestep: torch.Tensor | None,
) -> Conditioning:
    """diffusers' preamble: the image rows' time embedding at `timestep`, the text and reference
    rows' at 0 (plus the flow map's target embedding), each expanded per token; then per mode (text,
    image, reference) its two modulations, input projection and RoPE tables."""
    batch, image_tokens = hidden_states.shape[:2]
    dtype = hidden_states.dtype
    image_temb = _time_embedding(model, host, timestep.to(dtype) * 1000, model.timestep_embedder)
    zero_temb = _time_embedding(
        model, host, torch.zeros(batch, device=hidden_states.device, dtype=dtype), model.timestep_embedder
    )
    if target_timestep is not None:
        target_temb = _time_embedding(
            model, host, target_timestep.to(dtype) * 1000, model.target_timestep_embedder
        )
        image_temb = image_temb + target_temb
        zero_temb = zero_temb + target_temb
    # diffusers takes the silu of the expanded rows, for the image modulations and again in the
    # output norm: an elementwise op, so its rows are the silu of the one row, made once here and
    # written out contiguous as diffusers' is (the Linears see the same input, in the same layout).
    image_act = F.silu(image_temb).expand(batch, image_tokens, -1).contiguous()
    image_temb = image_temb.expand(batch, image_tokens, -1)
    zero_temb_act = F.silu(zero_temb)
    text_act = zero_temb_act.expand(batch, encoder_hidden_states.shape[1], -1)
    text = _mode(model, host, "txt", text_act, encoder_hidden_states, txt_ids)
    image = _mode(model, host, "image", image_act, hidden_states, img_ids)
    reference = None
    if image_cond_hidden_states is not None:
        cond_act = zero_temb_act.expand(batch, image_cond_hidden_states.shape[1], -1)
        reference = _mode(model, host, "image_cond", cond_act, image_cond_hidden_states, image_cond_ids)
    return Conditioning(image_temb, image_act, text, image, reference)


def _joint_rope(*modes: ModeInputs) -> Rope:
    return torch.cat([mode.rope[0] for mode in modes]), torch.cat([mode.rope[1] for mode in modes])


def transformer(model: nn.Module, host: Host, fusion: Fusion, cond: Conditioning) -> torch.Tensor:
    """The blocks and the output in diffusers' order: each mode's stack (text, image, reference),
    the joint single blocks over [text, image, reference], the output norm of the image rows and
    the output projection. Streams stay pending between plain blocks."""
    streams: list[Stream] = []
    modes = [(cond.text, model.txt_mode_blocks), (cond.image, model.mode_blocks["image"])]
    if cond.reference is not None:
        modes.append((cond.reference, model.mode_blocks["image_cond"]))
    for mode, blocks in modes:
        x: Stream = mode.x
        rows = uniform_rows.check(mode.early_mod, enabled=fusion.fused)
        for block in blocks:
            x = mode_block(block, host, fusion, x, mode.early_mod, mode.rope, rows)
        streams.append(x)
    c, content = streams[0], streams[1]
    content_mod = cond.image.single_mod
    if cond.reference is not None:  # the content rows: image, then reference
        content = torch.cat([materialize(content), materialize(streams[2])], dim=1)
        content_mod = torch.cat([content_mod, cond.reference.single_mod], dim=1)
        rope = _joint_rope(cond.text, cond.image, cond.reference)
        # Image rows at the step's time, reference rows at 0: their rows differ, nothing to prove.
        content_rows = None
    else:
        rope = _joint_rope(cond.text, cond.image)
        content_rows = uniform_rows.check(content_mod, enabled=fusion.fused)
    text_rows = uniform_rows.check(cond.text.single_mod, enabled=fusion.fused)
    for block in model.single_transformer_blocks:
        c, content = single_block(
            block, host, fusion, c, content, content_mod, cond.text.single_mod, rope, content_rows, text_rows
        )
    image_tokens = cond.image.x.shape[1]
    if cond.reference is not None:  # the reference rows produce no output
        content = materialize(content)[:, :image_tokens]
    out = output_norm(model.norm_out, host, fusion, content, cond.image_temb, cond.image_act)
    return host.linear(model.proj_out, out)
