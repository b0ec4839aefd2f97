"""Block code every family shares: the pieces FLUX.1 and FLUX.2 compute alike.

Both families modulate an affine-free LayerNorm with (shift, scale, gate) triples split from one
projection, normalize each head of q and k with an RMSNorm and rotate them with the same fp32 RoPE
(`apply_rotary_emb`, interleaved pairs), attend over text rows followed by image rows, and end with
diffusers' `AdaLayerNormContinuous`. What differs (where the modulation comes from, the MLP, the
order of the output projections) stays in each family's `blocks.py`. Like the families' block code,
everything here reaches the framework only through `flux2_fused.host.Host`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import float8_linear
from ..host import Attention, Host, RMSNormParameters
from ..ops import gelu_tanh, qk_norm_rope, swiglu
from ..ops.qk_norm_rope import Segment
from .deferral import Fusion, Stream, materialize, stream_dtype

# (cos, sin) RoPE tables, [S_txt + S_img, head_dim] each, text rows first.
Rope = tuple[torch.Tensor, torch.Tensor]
# A projection's rows [B, S, H, head_dim] for the prologue, with the q/k norm module that normalizes them.
Part = tuple[torch.Tensor, nn.Module]
# A host's own rotation of the normalized joint q and k [B, S, H, head_dim] -> (q, k).
Rotation = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class HostRope(tuple):
    """The RoPE of a host whose rotation is its own (ComfyUI's `apply_rope`, comfy-kitchen's kernel
    where installed, Qwen-Image's `apply_rotary_emb_qwen`): `rotate` is that rotation, which the
    prologue runs after the norms' module calls wherever it does not launch; `rotation` names the
    fused prologue's rotation that computes it (`qk_norm_rope.reference.ROTATIONS`), None where none
    does, and the tuple then holds its (cos, sin) tables, else nothing; `embedding` is the RoPE as
    the host's own modules take it (`module_rope`), where they take one."""

    def __new__(
        cls, tables: tuple, rotate: Rotation, rotation: str | None = None, embedding: Any = None
    ) -> HostRope:
        rope = super().__new__(cls, tables)
        rope.rotate = rotate
        rope.rotation = rotation
        rope.embedding = embedding
        return rope


def module_rope(rope: Rope | HostRope) -> Any:
    """The RoPE argument a host's attention module takes in its own call: a `HostRope`'s embedding,
    else the (cos, sin) tables themselves (diffusers' FLUX)."""
    return rope.embedding if isinstance(rope, HostRope) else rope


# A block's attention arguments as the host passes them (diffusers' `joint_attention_kwargs`).
Options = Mapping[str, Any] | None


def split_modulation(mod: torch.Tensor, sets: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Split a [B, 3*sets*D] modulation into `sets` (shift, scale, gate) triples of [B, 1, D] views, as
    diffusers' `Flux2Modulation.split` and `AdaLayerNormZero(Single)`'s chunks do; a per-token
    [B, S, 3*sets*D] one (KV editing's blend of reference and image rows) into [B, S, D] views."""
    chunks = (mod.unsqueeze(1) if mod.ndim == 2 else mod).chunk(3 * sets, dim=-1)
    return [(chunks[3 * i], chunks[3 * i + 1], chunks[3 * i + 2]) for i in range(sets)]


def layer_norms_plain(host: Host, module: nn.Module, names: Iterable[str]) -> bool:
    """The named LayerNorms are plain affine-free LayerNorms (`host.layer_norm` vouches for each),
    which the fused sites replace."""
    return all(host.layer_norm(getattr(module, name)) is not None for name in names)


def qk_norms(host: Host, norms: Iterable[nn.Module]) -> list[RMSNormParameters] | None:
    """Each q/k norm's (weight, eps, arithmetic), where the host vouches for every one as an RMSNorm
    (`host.rms_norm`) and they share one eps and one arithmetic (a fused launch takes one); else
    None."""
    params = [host.rms_norm(norm) for norm in norms]
    if any(p is None for p in params) or len({(p.eps, p.norm) for p in params}) != 1:
        return None
    return params


def prologue(
    host: Host,
    fusion: Fusion,
    q: list[Part],
    k: list[Part],
    rope: Rope,
    v: list[torch.Tensor] | None = None,
) -> qk_norm_rope.Prologue:
    """q, k (and v) for attention: each q and k part's heads [B, S, H, hd] through its RMSNorm,
    concatenated along tokens (text first), rotated; v's parts concatenated alike (None when not
    given): one fused launch where the op accepts. Norms the host does not vouch for as RMSNorms
    (`host.rms_norm`), or of more than one eps (a launch takes one), run as the host's module calls.
    A host's own rotation (`HostRope`) is the op's `rotation` where one computes it, in a launch
    only (not a torch.compile trace): wherever that launch declines, the norms' module calls and the
    host's rotation run, the host's code in place of the op's eager chain."""
    rotate = getattr(rope, "rotate", None)
    norms = qk_norms(host, (norm for _, norm in (*q, *k)))
    if norms is not None and rotate is not None:
        if rope.rotation is not None and fusion.fused and not torch.compiler.is_compiling():
            out = qk_norm_rope.fused(
                *_segments(norms, q, k), *rope, norms[0].eps, v, rotation=rope.rotation, norm=norms[0].norm
            )
            if out is not None:
                return out
        norms = None
    if norms is None:
        # The norms as module calls, in diffusers' order: the last (image) part's q and k first.
        normed_q, normed_k = [None] * len(q), [None] * len(k)
        for i in reversed(range(len(q))):
            normed_q[i] = host.call(q[i][1], q[i][0])
            normed_k[i] = host.call(k[i][1], k[i][0])
        query, key = (
            torch.cat(normed, dim=1) if len(normed) > 1 else normed[0] for normed in (normed_q, normed_k)
        )
        if rotate is not None:
            query, key = rotate(query, key)
        else:
            query, key = (qk_norm_rope.reference.rope(t, *rope) for t in (query, key))
        return query, key, None if v is None else torch.cat(v, dim=1)
    return qk_norm_rope.apply(
        *_segments(norms, q, k), *rope, norms[0].eps, v, norm=norms[0].norm, enabled=fusion.fused
    )


def _segments(norms: list[RMSNormParameters], q: list[Part], k: list[Part]) -> list[list[Segment]]:
    """The op's q and k segments: each part's rows with its norm's weight (`norms` in q's then k's
    order)."""
    weights = iter(params.weight for params in norms)
    return [[Segment(x, next(weights)) for x, _ in parts] for parts in (q, k)]


def qkv_linears(attn: nn.Module, separate: tuple[str, str, str], fused: str) -> tuple[nn.Module, ...]:
    """The Linears `qkv_projections` calls: the three named `separate`, or where the module's
    projections are fused (`fused_projections`) the one named `fused`."""
    if getattr(attn, "fused_projections", False):
        return (getattr(attn, fused),)
    return tuple(getattr(attn, name) for name in separate)


def float8_rows(host: Host, linears: Iterable[nn.Module]) -> bool:
    """Whether a norm read by these Linears alone may hand them its out quantized (`Fusion.norm`'s
    `float8_rows`): there is one at least, and each quantizes its input per row for torchao's float8
    GEMM where it takes it quantized (`Host.float8_input`)."""
    found = False
    for linear in linears:
        if host.float8_input(linear) != "row":
            return False
        found = True
    return found


def attention_float8_rows(host: Host, attn: nn.Module) -> tuple[bool, bool]:
    """Whether a double block's two norms before its attention may come as torchao's per-row float8
    (`float8_rows`): (the image rows', read by `to_q`, `to_k`, `to_v`; the text rows', read by the
    `add_*_proj`s), either fused into one projection."""
    image = float8_rows(host, qkv_linears(attn, ("to_q", "to_k", "to_v"), "to_qkv"))
    text = float8_rows(host, qkv_linears(attn, ("add_q_proj", "add_k_proj", "add_v_proj"), "to_added_qkv"))
    return image, text


def qkv_projections(
    attn: nn.Module,
    host: Host,
    x: torch.Tensor | float8_linear.Quantized,
    separate: tuple[str, str, str],
    fused: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [B, S, H, head_dim] of rows x (or of their float8, `Fusion.norm`'s): the Linears of
    `qkv_linears`, one fused projection's output chunked in three. diffusers' generic `Attention`
    (Qwen-Image's) has no `head_dim`: its processor divides `inner_dim` by `heads`."""
    head_dim = getattr(attn, "head_dim", None) or attn.inner_dim // attn.heads
    shape = (-1, head_dim)
    linears = qkv_linears(attn, separate, fused)
    if len(linears) == 1:
        parts = host.linear(linears[0], x).chunk(3, dim=-1)
    else:
        with float8_linear.shared(x):
            parts = tuple(host.linear(linear, x) for linear in linears)
    query, key, value = (t.unflatten(-1, shape) for t in parts)
    return query, key, value


def joint_attention_rows(
    attn: nn.Module,
    host: Host,
    fusion: Fusion,
    x: torch.Tensor | float8_linear.Quantized,
    c: torch.Tensor | float8_linear.Quantized,
    rope: Rope,
    attend: Attention,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A double block's joint attention up to its output projections: x [B, N, D] image rows, c
    [B, L, D] text rows, each through its own q, k, v projections (`to_*` and `add_*_proj`), the
    prologue (text first, as in the RoPE tables), `attend` (the host's backend) -> the attention
    output's (text rows, image rows). Which output projection runs first is the family's.
    Projections fused into one Linear a stream (`fused_projections`: diffusers' `to_qkv` and
    `to_added_qkv`, ComfyUI's `qkv`) give q, k, v as thirds of its output, as their callers split
    it."""
    query, key, value = qkv_projections(attn, host, x, ("to_q", "to_k", "to_v"), "to_qkv")
    c_query, c_key, c_value = qkv_projections(
        attn, host, c, ("add_q_proj", "add_k_proj", "add_v_proj"), "to_added_qkv"
    )
    query, key, value = prologue(
        host,
        fusion,
        [(c_query, attn.norm_added_q), (query, attn.norm_q)],
        [(c_key, attn.norm_added_k), (key, attn.norm_k)],
        rope,
        [c_value, value],
    )
    out = attend(query, key, value)
    c_out, x_out = out.split_with_sizes([c.shape[1], x.shape[1]], dim=1)
    return c_out, x_out


# One stream's part of a double block after its attention: (the stream, the attention output, the
# attention's gate, the MLP's (shift, scale, gate) modulation).
StreamUpdate = tuple[Stream, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# A family's feed-forward dispatcher: (ff module, host, fusion, normed rows) -> the MLP's output.
FeedForward = Callable[[nn.Module, Host, Fusion, torch.Tensor], torch.Tensor]


def double_block_mlps(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    image: StreamUpdate,
    text: StreamUpdate,
    feed_forward: FeedForward,
    feed_forward_inputs: Callable[[Host, nn.Module], tuple[nn.Module, ...]] | None = None,
) -> tuple[Stream, Stream]:
    """The rest of a double block, as both families write it, for the image stream then the text
    stream (diffusers' order): the gated attention residual, the modulated `norm2`, the feed-forward
    (`ff`, `ff_context`) and its gated residual, left pending; the text stream clipped in fp16 (so
    materialized there). `feed_forward_inputs(host, ff)`: the Linears `feed_forward` reads the norm
    with (none where it calls the module), whose float8 rows the norm may give them (`float8_rows`)."""
    streams = []
    for (stream, attn_out, gate_msa, (shift, scale, gate)), norm, ff, clip_fp16 in (
        (image, block.norm2, block.ff, False),
        (text, block.norm2_context, block.ff_context, True),
    ):
        quantize = feed_forward_inputs is not None and float8_rows(host, feed_forward_inputs(host, ff))
        updated = fusion.add(stream, attn_out, gate_msa)
        normed, stream = fusion.norm(updated, scale, shift, norm.eps, float8_rows=quantize)
        mlp = feed_forward(ff, host, fusion, normed)
        streams.append(fusion.add(stream, mlp, gate, clip_fp16=clip_fp16))
    return streams[0], streams[1]


def call_double_block(
    host: Host, block: nn.Module, x: Stream, c: Stream, rope: Rope, options: Options, **conditioning: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """A double block as the host calls it, on the streams materialized (hooks see real tensors),
    `conditioning` the family's keyword arguments for it; (image, text) back."""
    c_out, x_out = host.call(
        block,
        hidden_states=materialize(x),
        encoder_hidden_states=materialize(c),
        image_rotary_emb=rope,
        joint_attention_kwargs=options,
        **conditioning,
    )
    return x_out, c_out


def output_norm_body(
    norm_out: nn.Module, host: Host, fusion: Fusion, x: Stream, temb: torch.Tensor
) -> torch.Tensor:
    """diffusers' `AdaLayerNormContinuous` as both families use it: its own Linear on silu(temb), cast
    to the stream's dtype, gives (scale, shift) - scale FIRST, unlike the blocks' (shift, scale,
    gate) - around an affine-free LayerNorm of a stream nothing reads afterwards."""
    scale, shift = host.linear(norm_out.linear, F.silu(temb).to(stream_dtype(x))).chunk(2, dim=1)
    return fusion.output_norm(x, scale[:, None, :], shift[:, None, :], norm_out.norm.eps)


def output_norm_plain(host: Host, norm_out: nn.Module) -> bool:
    """The output norm's body may run: it, its LayerNorm and its SiLU (where it has one as a module)
    are plain."""
    silu = getattr(norm_out, "silu", None)
    return (
        host.plain(norm_out)
        and layer_norms_plain(host, norm_out, ("norm",))
        and (silu is None or host.plain(silu))
    )


def output_norm(
    norm_out: nn.Module, host: Host, fusion: Fusion, x: Stream, temb: torch.Tensor
) -> torch.Tensor:
    """The output norm: its body where `output_norm_plain`, else its own call on the stream
    materialized."""
    if output_norm_plain(host, norm_out):
        return output_norm_body(norm_out, host, fusion, x, temb)
    return host.call(norm_out, materialize(x), temb)


# The MLPs FLUX.2 and FLUX.3 share (diffusers' `Flux2FeedForward` / `Flux3FeedForward`: SwiGLU), and
# ComfyUI's FLUX.1 MLP, which its FLUX model holds in the same layout (Linear, tanh GELU, Linear).


def activation_plain(host: Host, act: nn.Module | None) -> bool:
    """An MLP's activation an op may compute: none held as a module (the package's model: SwiGLU), a
    plain SwiGLU module whose children are plain SiLUs (diffusers' `Flux2SwiGLU`, ComfyUI's
    `SiLUActivation`), or a plain tanh-approximated `nn.GELU` (ComfyUI's FLUX.1 MLPs)."""
    if act is None:
        return True
    if type(act) is nn.GELU:
        return act.approximate == "tanh" and host.plain(act)
    children = list(act.children())
    return host.plain(act) and all(type(child) is nn.SiLU and host.plain(child) for child in children)


def activation_op(act: nn.Module | None) -> ModuleType:
    """The op computing the activation `act` stands for (`activation_plain`): tanh GELU or SwiGLU."""
    return gelu_tanh if type(act) is nn.GELU else swiglu


def project_activation(
    host: Host,
    linear: nn.Module,
    op: ModuleType,
    fusion: Fusion,
    x: torch.Tensor,
    *,
    prefix: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
) -> torch.Tensor:
    """`linear(cat([prefix, op(x)], dim=-1))` (op(x, b) for SwiGLU's two-tensor form; no cat without
    a prefix), the activation computed by its row-wise op (`gelu_tanh`, `swiglu`) straight into its
    place in the joint buffer. Where the host quantizes `linear`'s input for torchao's float8 GEMM,
    the op's kernels give that quantization of the joint row instead (`float8_linear.Quantized`):
    per row in the same launch, the activation itself never written or read back; per tensor the
    joint rows with their amax words, then one streaming launch (no copy of the prefix, no amax
    pass)."""

    def activation() -> torch.Tensor:
        if prefix is not None:
            return op.concat(prefix, x, enabled=fusion.fused)
        return op.apply(x, enabled=fusion.fused) if b is None else op.apply(x, b=b, enabled=fusion.fused)

    granularity = host.float8_input(linear) if fusion.fused else None
    if granularity is not None:
        if b is None:
            quantized = op.quantized(x, prefix=prefix, granularity=granularity)
        else:  # SwiGLU's two-tensor form (gelu_tanh takes no b)
            quantized = op.quantized(x, b=b, granularity=granularity)
        if quantized is not None:
            return host.linear(linear, float8_linear.Quantized(*quantized, granularity, x.dtype, activation))
    return host.linear(linear, activation())


def mlp(ff: nn.Module, host: Host, fusion: Fusion, x: torch.Tensor | float8_linear.Quantized) -> torch.Tensor:
    """linear_in, the activation (`ff.act_fn`, SwiGLU where it has none), linear_out."""
    op = activation_op(getattr(ff, "act_fn", None))
    return project_activation(host, ff.linear_out, op, fusion, host.linear(ff.linear_in, x))


def feed_forward_plain(host: Host, ff: nn.Module) -> bool:
    """The block code may compute this MLP: `ff` and its activation module (where it has one) plain."""
    return host.plain(ff) and activation_plain(host, getattr(ff, "act_fn", None))


def feed_forward(
    ff: nn.Module, host: Host, fusion: Fusion, x: torch.Tensor | float8_linear.Quantized
) -> torch.Tensor:
    """The block code's MLP where `ff` (and its activation module, where it has one) is plain, else
    the module's own call (on x's values, where x came quantized)."""
    if feed_forward_plain(host, ff):
        return mlp(ff, host, fusion, x)
    return host.call(ff, float8_linear.dense(x))


def feed_forward_inputs(host: Host, ff: nn.Module) -> tuple[nn.Module, ...]:
    """The Linears `feed_forward` reads its input with: the MLP's `linear_in`, none where the
    module's own call runs."""
    return (ff.linear_in,) if feed_forward_plain(host, ff) else ()
