"""Z-Image's block as functions of its modules, written against `flux2_fused.host.Host`.

diffusers' `ZImageTransformerBlock` is a single-stream block over joint rows (the refiners' image or
caption rows, the main layers' image rows then caption rows), D = 30 heads x 128 in Z-Image-Turbo:
- with modulation (the main layers and the noise refiner) a Linear on the timestep embedding gives
  (scale_msa, gate_msa, scale_mlp, gate_mlp), the gates through tanh and the scales as 1 + scale;
  `x + gate_msa * attention_norm2(attention(attention_norm1(x) * scale_msa))`, then the same with
  `ffn_norm1`/`ffn_norm2` around the feed-forward (a "sandwich" of diffusers `RMSNorm`s with weights);
  without modulation (the caption refiner) the same with no scale or gate;
- attention (`ZSingleStreamAttnProcessor`): q, k, v from three Linears, diffusers' `RMSNorm` per head
  (eps 1e-5), RoPE as a complex product with per-sample frequencies [B, S, 64] in fp32, SDPA under
  the padding mask, the output Linear;
- the feed-forward is `w2(silu(w1(x)) * w3(x))`.
The fused sites are the attention prologue (both q/k norms and the rotation in one launch: "mean"
norm, "complex" rotation, a table a sample), the sandwich norms (`sandwich_norm`: three launches a
block, each a norm of a block output with its gated residual and the next norm with its scale) and
the feed-forward's SwiGLU of its two projections (`swiglu` with `b`); the modulation and the
projections are the modules' own calls in diffusers' order. Where only torchao's per-row float8
Linears read a sandwich site's next norm (q, k, v; w1 and w3), the site writes their quantization
of it instead (`sandwich_norm.quantized`).
Per-token modulation (the Omni models' `noise_mask`) runs diffusers' own forward.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ... import float8_linear
from ...float8_linear import Quantized, dense
from ...host import Host, methods_unpatched
from ...ops import sandwich_norm, swiglu
from ...ops.qk_norm_rope.reference import complex_tables
from ..common import HostRope, float8_rows, project_activation, prologue, qkv_projections
from ..deferral import Fusion

MODULE = "diffusers.models.transformers.transformer_z_image"
# The attention module's keyword for the padding mask.
MASK = "attention_mask"


def _rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """The processor's own rotation of [B, S, H, hd] rows by per-sample frequencies [B, S, hd/2], as
    it writes it (autocast off, the complex product in fp32, back to x's dtype)."""
    with torch.amp.autocast("cuda", enabled=False):
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * freqs_cis.unsqueeze(2)).flatten(3).type_as(x)


def host_rope(freqs_cis: torch.Tensor) -> HostRope:
    """Z-Image's RoPE for the prologue: the "complex" rotation with the tables of the per-sample
    frequencies, and the processor's rotation wherever the launch declines."""

    def rotate(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _rotate(query, freqs_cis), _rotate(key, freqs_cis)

    return HostRope(tuple(complex_tables(freqs_cis)), rotate, "complex", freqs_cis)


def attention(
    attn: nn.Module,
    host: Host,
    fusion: Fusion,
    h: torch.Tensor | Quantized,
    mask: torch.Tensor | None,
    freqs_cis: torch.Tensor,
) -> torch.Tensor:
    """The attention module on rows h: q, k, v from its Linears, the prologue (its two norms and the
    rotation), the host's attention under the mask, the output Linear; the module's own call where
    the host has no attention for it, its q/k norms are missing or its projections are fused
    (the processor keeps using the separate Linears; on h's values, where h came quantized)."""
    options = {MASK: mask} if mask is not None else None
    attend = host.attention(attn, options, 0)
    if attend is None or not attention_parts(attn):
        return host.call(attn, dense(h), attention_mask=mask, freqs_cis=freqs_cis)
    query, key, value = qkv_projections(attn, host, h, ("to_q", "to_k", "to_v"), "to_qkv")
    rope = host_rope(freqs_cis)
    query, key, _ = prologue(host, fusion, [(query, attn.norm_q)], [(key, attn.norm_k)], rope)
    return host.linear(attn.to_out[0], attend(query, key, value))


def attention_parts(attn: nn.Module) -> bool:
    """The attention has what its block code computes with: both q/k norms, separate projections."""
    norms = attn.norm_q is not None and attn.norm_k is not None
    return norms and not getattr(attn, "fused_projections", False)


def feed_forward_plain(host: Host, ff: nn.Module) -> bool:
    """The host may compute the module's forward and its `_forward_silu_gating` is its own (on the
    class and the instance)."""
    return host.plain(ff) and methods_unpatched(type(ff), GATING) and GATING[0] not in ff.__dict__


def feed_forward(ff: nn.Module, host: Host, fusion: Fusion, h: torch.Tensor | Quantized) -> torch.Tensor:
    """`w2(silu(w1(h)) * w3(h))` with the SwiGLU of the two projections by the op, where
    `feed_forward_plain`; else the module's own call (on h's values, where h came quantized)."""
    if not feed_forward_plain(host, ff):
        return host.call(ff, dense(h))
    with float8_linear.shared(h):
        gate, up = host.linear(ff.w1, h), host.linear(ff.w3, h)
    return project_activation(host, ff.w2, swiglu, fusion, gate, b=up)


def modulation(block: nn.Module, host: Host, adaln_input: torch.Tensor) -> list[torch.Tensor]:
    """(scale_msa, gate_msa, scale_mlp, gate_mlp) [B, 1, D] as the block computes them: tanh gates,
    1 + scale."""
    mod = host.call(block.adaLN_modulation, adaln_input)
    scale_msa, gate_msa, scale_mlp, gate_mlp = mod.unsqueeze(1).chunk(4, dim=2)
    return [1.0 + scale_msa, gate_msa.tanh(), 1.0 + scale_mlp, gate_mlp.tanh()]


def _scaled(h: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return h if scale is None else h * scale


def _gated(x: torch.Tensor, update: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return x + (update if gate is None else gate * update)


def sandwich_weights(host: Host, block: nn.Module) -> tuple[list[torch.Tensor], float] | None:
    """The weights of the block's four sandwich norms (NORMS order) and their one eps, where the host
    vouches for each as diffusers' plain `RMSNorm` (the "mean" arithmetic `sandwich_norm` computes);
    None where one is not (a hook, another class) or they differ in eps."""
    params = [host.rms_norm(getattr(block, name)) for name in NORMS]
    if any(p is None or p.norm != "mean" for p in params) or len({p.eps for p in params}) != 1:
        return None
    return [p.weight for p in params], params[0].eps


def block_call(
    block: nn.Module,
    host: Host,
    fusion: Fusion,
    x: torch.Tensor,
    attn_mask: torch.Tensor | None,
    freqs_cis: torch.Tensor | None,
    adaln_input: torch.Tensor | None = None,
    noise_mask: torch.Tensor | None = None,
    adaln_noisy: torch.Tensor | None = None,
    adaln_clean: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """A block as diffusers calls one (its arguments, the new rows back), in diffusers' order and
    rounding: its sandwich norms as three `sandwich_norm` sites (the first norm times the scale; the
    attention's gated update with the feed-forward's first norm; the feed-forward's gated update)
    where the host vouches for all four, else their module calls. None (diffusers' own forward) for
    per-token modulation, without RoPE frequencies, or where the modulated block has no timestep
    embedding."""
    if noise_mask is not None or freqs_cis is None or (block.modulation and adaln_input is None):
        return None
    scale_msa = gate_msa = scale_mlp = gate_mlp = None
    if block.modulation:
        scale_msa, gate_msa, scale_mlp, gate_mlp = modulation(block, host, adaln_input)
    weights = sandwich_weights(host, block)
    if weights is None:
        h = _scaled(host.call(block.attention_norm1, x), scale_msa)
        attn_out = attention(block.attention, host, fusion, h, attn_mask, freqs_cis)
        x = _gated(x, host.call(block.attention_norm2, attn_out), gate_msa)
        h = _scaled(host.call(block.ffn_norm1, x), scale_mlp)
        mlp = feed_forward(block.feed_forward, host, fusion, h)
        return _gated(x, host.call(block.ffn_norm2, mlp), gate_mlp)
    (attention_norm1, attention_norm2, ffn_norm1, ffn_norm2), eps = weights
    site = partial(sandwich_norm.apply, eps=eps, enabled=fusion.fused)
    attn, ff = block.attention, block.feed_forward
    readers = (attn.to_q, attn.to_k, attn.to_v) if attention_parts(attn) else ()
    h, _ = normed_site(host, fusion, readers, x, attention_norm1, eps, scale=scale_msa)
    attn_out = attention(attn, host, fusion, h, attn_mask, freqs_cis)
    readers = (ff.w1, ff.w3) if feed_forward_plain(host, ff) else ()
    update = {"update": attn_out, "update_weight": attention_norm2, "gate": gate_msa}
    h, x = normed_site(host, fusion, readers, x, ffn_norm1, eps, scale=scale_mlp, **update)
    mlp = feed_forward(ff, host, fusion, h)
    _, x = site(x, None, update=mlp, update_weight=ffn_norm2, gate=gate_mlp)
    return x


def normed_site(
    host: Host,
    fusion: Fusion,
    readers: tuple[nn.Module, ...],
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    **kwargs: torch.Tensor | None,
) -> tuple[torch.Tensor | Quantized, torch.Tensor]:
    """A sandwich site with a next norm that the `readers` Linears alone read: (its out, the stream).
    Where each of them quantizes its input per row for torchao's float8 GEMM (`float8_rows`), the out
    comes as that quantization from the site's quantizing form where it takes the call; its `dense`
    computes the values from the stream with the plain site, the same bits. Else
    `sandwich_norm.apply`."""
    if fusion.fused and float8_rows(host, readers):
        got = sandwich_norm.quantized(x, weight, eps, **kwargs)
        if got is not None:
            q, q_scale, stream = got
            scale = kwargs.get("scale")

            def values() -> torch.Tensor:
                out, _ = sandwich_norm.apply(stream, weight, eps, scale, enabled=fusion.fused)
                assert out is not None
                return out

            return Quantized(q, q_scale, "row", stream.dtype, values), stream
    out, stream = sandwich_norm.apply(x, weight, eps, enabled=fusion.fused, **kwargs)
    assert out is not None
    return out, stream


# The feed-forward's gating method, which its forward calls (a replacement of it must run).
GATING = ("_forward_silu_gating",)
# The block's sandwich norms: attention's pair, then the feed-forward's.
NORMS = ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2")
