"""FLUX.2's blocks as functions of their modules: one implementation for both hosts.

The package's `Flux2Transformer` and diffusers' `Flux2Transformer2DModel` name their submodules
alike (`norm1`, `attn.to_q`, `attn.norm_added_k`, `ff.linear_in`, `attn.to_qkv_mlp_proj`, ...),
so these functions take a block (or its attention, feed-forward, output norm) of either host and
run diffusers' eager computation through `Fusion`, which sends each fusable site to its fused op
where the guards prove it exact. Every Linear is called as a module, so whatever wraps it (a LoRA
layer, a quantized linear, an offload hook) runs as in diffusers, with the parameters it holds at
call time. Modules whose forward these functions replace (norms, the attention's processor, the
SwiGLU) must be plain: `bypassable` says when they are, and the hosts call the module itself where
they are not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import qk_norm_rope
from .deferral import Fusion, PendingConcat, Stream, stream_rows

# (cos, sin) RoPE tables, [S_txt + S_img, head_dim] each, text rows first.
Rope = tuple[torch.Tensor, torch.Tensor]


def has_hooks(module: nn.Module) -> bool:
    """Whether calling `module` would run forward hooks (its own or global ones)."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or torch.nn.modules.module._global_forward_hooks
        or torch.nn.modules.module._global_forward_pre_hooks
    )


def bypassable(module: nn.Module) -> bool:
    """Whether skipping `module`'s call changes nothing: no hooks, no forward replaced on the
    instance (accelerate's offload and diffusers' cache hooks wrap `forward` that way), and not
    compiled on its own (`module.compile()`, as diffusers' `compile_repeated_blocks` does)."""
    return (
        not has_hooks(module)
        and "forward" not in module.__dict__
        and getattr(module, "_compiled_call_impl", None) is None
    )


def split_modulation(mod: torch.Tensor, sets: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Split a [B, 3*sets*D] modulation into `sets` (shift, scale, gate) triples of [B, 1, D] views, as
    diffusers' `Flux2Modulation.split` does; a per-token [B, S, 3*sets*D] one (KV editing's blend of
    reference and image rows) into [B, S, D] views."""
    chunks = (mod.unsqueeze(1) if mod.ndim == 2 else mod).chunk(3 * sets, dim=-1)
    return [(chunks[3 * i], chunks[3 * i + 1], chunks[3 * i + 2]) for i in range(sets)]


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """SDPA on [B, S, H, hd] tensors -> [B, S, H * hd].

    The inputs are handed to SDPA as permuted [B, H, S, hd] views, not contiguous copies, exactly as
    diffusers' native backend does, so SDPA picks the same kernel and gives the same bits.
    """
    query, key, value = (t.permute(0, 2, 1, 3) for t in (query, key, value))
    out = F.scaled_dot_product_attention(query, key, value)
    return out.permute(0, 2, 1, 3).flatten(2, 3)


def prologue(
    fusion: Fusion,
    q: list[tuple[torch.Tensor, nn.Module]],
    k: list[tuple[torch.Tensor, nn.Module]],
    rope: Rope,
    v: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q, k (and v) for attention: each q and k part's heads [B, S, H, hd] through its RMSNorm,
    concatenated along tokens (text first), rotated; v's parts concatenated alike (None when not
    given): one fused launch where the guards accept. If any norm is not a plain RMSNorm (hooks, a
    replacement), every norm runs as a module call."""
    norms = [norm for _, norm in (*q, *k)]
    plain = all(type(norm) is nn.RMSNorm and bypassable(norm) for norm in norms)
    if not plain or len({norm.eps for norm in norms}) != 1 or norms[0].eps is None:
        joint = []
        for parts in (q, k):
            normed = [norm(x) for x, norm in parts]
            joint.append(
                qk_norm_rope.reference.rope(torch.cat(normed, dim=1) if len(normed) > 1 else normed[0], *rope)
            )
        return joint[0], joint[1], None if v is None else torch.cat(v, dim=1)
    segments = [[qk_norm_rope.Segment(x, norm.weight) for x, norm in parts] for parts in (q, k)]
    return fusion.qk_norm_rope(*segments, rope, norms[0].eps, v)


def double_attention(
    attn: nn.Module,
    fusion: Fusion,
    x: torch.Tensor,
    c: torch.Tensor,
    rope: Rope,
    sdpa: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = attention,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Joint attention of a double block: x [B, N, D] image rows, c [B, L, D] text rows -> (image
    update, text update). Text rows come first in the joint sequence (and in the RoPE tables).
    `sdpa` maps [B, S, H, hd] q, k, v to [B, S, H * hd]; a host passes its own attention dispatch
    (another backend, a context-parallel exchange), handed the same tensors as diffusers' processors
    hand theirs."""
    shape = (-1, attn.head_dim)
    query, key, value = (proj(x).unflatten(-1, shape) for proj in (attn.to_q, attn.to_k, attn.to_v))
    c_query, c_key, c_value = (
        proj(c).unflatten(-1, shape) for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
    )
    query, key, value = prologue(
        fusion,
        [(c_query, attn.norm_added_q), (query, attn.norm_q)],
        [(c_key, attn.norm_added_k), (key, attn.norm_k)],
        rope,
        [c_value, value],
    )
    out = sdpa(query, key, value)
    c_out, x_out = out.split_with_sizes([c.shape[1], x.shape[1]], dim=1)
    c_out = attn.to_add_out(c_out)  # before to_out, as diffusers calls them (adapter dropout draws in order)
    return attn.to_out[0](x_out), c_out


def parallel_attention(
    attn: nn.Module,
    fusion: Fusion,
    h: torch.Tensor,
    rope: Rope,
    sdpa: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = attention,
) -> torch.Tensor:
    """A single block's body: one Linear gives q, k, v and the MLP input, one maps the attention
    output and the SwiGLU activation back to D. The split follows diffusers' (q, k, v and the MLP
    part in proportion to their full widths, so a column-sharded projection splits alike); `sdpa`
    as in `double_attention`."""
    proj = attn.to_qkv_mlp_proj(h)
    qkv_dim = 3 * attn.inner_dim
    qkv_width = proj.shape[-1] * qkv_dim // (qkv_dim + attn.mlp_hidden_dim * attn.mlp_mult_factor)
    qkv, mlp = proj.split([qkv_width, proj.shape[-1] - qkv_width], dim=-1)
    query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
    query, key, _ = prologue(fusion, [(query, attn.norm_q)], [(key, attn.norm_k)], rope)
    out = sdpa(query, key, value)
    return attn.to_out(fusion.cat_swiglu(out, mlp))


def feed_forward(ff: nn.Module, fusion: Fusion, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP: linear_in D -> 2H, silu(a) * b, linear_out H -> D."""
    return ff.linear_out(fusion.swiglu(ff.linear_in(x)))


def double_block(
    block: nn.Module,
    fusion: Fusion,
    x: Stream,
    c: Stream,
    mod_img: torch.Tensor,
    mod_txt: torch.Tensor,
    rope: Rope,
    attend=double_attention,
    mlp=feed_forward,
) -> tuple[Stream, Stream]:
    """A double block on possibly-pending streams (image x, text c); returns both FFN updates pending.

    Stream by stream in diffusers' order: image attention residual, norm2, FFN residual; then the
    same for text, whose result is clipped in fp16. `attend` and `mlp` compute the attention and the
    feed-forward of `block.attn` and `block.ff` (the hosts pass module calls where those modules
    cannot be bypassed)."""
    (shift_msa, scale_msa, gate_msa), (shift_mlp, scale_mlp, gate_mlp) = split_modulation(mod_img, 2)
    (c_shift_msa, c_scale_msa, c_gate_msa), (c_shift_mlp, c_scale_mlp, c_gate_mlp) = split_modulation(
        mod_txt, 2
    )
    x_norm, x = fusion.norm(x, scale_msa, shift_msa, block.norm1.eps)
    c_norm, c = fusion.norm(c, c_scale_msa, c_shift_msa, block.norm1_context.eps)
    x_attn, c_attn = attend(block.attn, fusion, x_norm, c_norm, rope)
    x_norm, x = fusion.norm(fusion.add(x, x_attn, gate_msa), scale_mlp, shift_mlp, block.norm2.eps)
    x_next = fusion.add(x, mlp(block.ff, fusion, x_norm), gate_mlp)
    c_norm, c = fusion.norm(
        fusion.add(c, c_attn, c_gate_msa), c_scale_mlp, c_shift_mlp, block.norm2_context.eps
    )
    c_next = fusion.add(c, mlp(block.ff_context, fusion, c_norm), c_gate_mlp, clip_fp16=True)
    return x_next, c_next


def single_block(
    block: nn.Module, fusion: Fusion, h: Stream, mod: torch.Tensor, rope: Rope, attend=parallel_attention
) -> Stream:
    """A single block on a possibly-pending joint stream; returns its update pending (clipped in fp16)."""
    ((shift, scale, gate),) = split_modulation(mod, 1)
    h_norm, h = fusion.norm(h, scale, shift, block.norm.eps)
    return fusion.add(h, attend(block.attn, fusion, h_norm, rope), gate, clip_fp16=True)


def output_norm(
    norm_out: nn.Module, fusion: Fusion, x: Stream, temb: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """AdaLayerNormContinuous as FLUX.2 uses it: its own Linear on silu(temb), cast to the stream's
    dtype, gives (scale, shift) - scale FIRST, unlike the blocks' (shift, scale, gate) - around an
    affine-free LayerNorm of a stream nothing reads afterwards."""
    scale, shift = norm_out.linear(F.silu(temb).to(dtype)).chunk(2, dim=1)
    return fusion.output_norm(x, scale[:, None, :], shift[:, None, :], norm_out.norm.eps)


def joint_rope(
    pos_embed: nn.Module, img_ids: torch.Tensor, txt_ids: torch.Tensor, device: torch.device
) -> Rope:
    """Joint RoPE tables, text rows first, built where the ids live and then moved to `device`.

    Batched ids [B, S, n_axes] use the first batch element's ids, as diffusers does.
    """
    img_cos, img_sin = pos_embed(img_ids[0] if img_ids.ndim == 3 else img_ids)
    txt_cos, txt_sin = pos_embed(txt_ids[0] if txt_ids.ndim == 3 else txt_ids)
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
    temb = model.time_guidance_embed(timestep, guidance)
    mod_img = model.double_stream_modulation_img(temb)
    mod_txt = model.double_stream_modulation_txt(temb)
    mod_single = model.single_stream_modulation(temb)
    if blend is not None:
        mod_img, mod_single = blend(timestep, guidance, mod_img, mod_single)
    return Conditioning(
        timestep=timestep,
        guidance=guidance,
        temb=temb,
        mod_img=mod_img,
        mod_txt=mod_txt,
        mod_single=mod_single,
        x=model.x_embedder(hidden_states),
        c=model.context_embedder(encoder_hidden_states),
        rope=joint_rope(model.pos_embed, img_ids, txt_ids, hidden_states.device),
    )


def transformer(
    model: nn.Module,
    fusion: Fusion,
    cond: Conditioning,
    *,
    run_double,
    run_single,
    run_output,
    leading_rows: int,
) -> torch.Tensor:
    """The blocks and the output in diffusers' order: double blocks, the text-first concat, single
    blocks, the output norm of the rows after the first `leading_rows` (the text, and in KV
    extraction the reference rows too) and the output projection. The hosts pass how each block and
    the output norm run (`run_double(index, block, fusion, x, c, mod_img, mod_txt, rope)`,
    `run_single(index, block, fusion, h, mod, rope)`, `run_output(norm_out, fusion, rows, temb)`);
    streams stay pending between blocks."""
    x: Stream = cond.x
    c: Stream = cond.c
    for index, block in enumerate(model.transformer_blocks):
        x, c = run_double(index, block, fusion, x, c, cond.mod_img, cond.mod_txt, cond.rope)
    h: Stream = PendingConcat(c, x)
    for index, block in enumerate(model.single_transformer_blocks):
        h = run_single(index, block, fusion, h, cond.mod_single, cond.rope)
    return model.proj_out(run_output(model.norm_out, fusion, stream_rows(h, leading_rows), cond.temb))
