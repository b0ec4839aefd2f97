"""FLUX.2 and FLUX.1 as ComfyUI writes them: `comfy.ldm.flux.model.Flux`, whose one set of block
classes computes both, on FLUX.2's block code.

ComfyUI's FLUX.1 is its FLUX.2 blocks with other parameters: each block projects its own modulation
(`img_mod`, `txt_mod`, `modulation`) where FLUX.2 shares three, and the MLPs are Linear, tanh GELU,
Linear (biased) where FLUX.2's are SiLU-gated; q, k, v, the single block's `linear1` split and the
output layer are the same code. So the binding hands FLUX.2's block code each block's modulation and
the GELU as the MLP's activation (`activate`: the `gelu_tanh` op where FLUX.2 runs `swiglu`).

ComfyUI's FLUX model computes the blocks with other modules and two other roundings than diffusers:
- its q, k, v come from one Linear a stream (`qkv`), split in thirds, as diffusers' fused
  projections do; the single block's `linear1` / `linear2` are diffusers' `to_qkv_mlp_proj` /
  `to_out`; `View`s give the block code those names (`double_view`, `single_view`);
- its modulation is `apply_mod`, `torch.addcmul(shift, norm, 1 + scale)`, which rounds the product
  and the sum once, and its fp16 streams saturate with `nan_to_num` (NaN to 0): the model's `Fusion`
  carries both (`make_fusion`), and the fused norms round as addcmul does;
- the output layer's adaLN chunks (shift, scale), shift first.
Only `forward_orig` is replaced: ComfyUI's `forward` (its wrappers), `_forward` (patchifying,
reference latents, ids) and everything around the model stay ComfyUI's.

A call runs on the block code only where the block code can do all of it (`model_reason`,
`blocks_reason`): FLUX.1's or FLUX.2's parameters, every block, attention, MLP, norm and modulation
plain for the host, ComfyUI's own FLUX attention functions, and nothing the block code does not
implement (ControlNet residuals, block replacements or patches from other nodes, attention masks,
per-token timestep-zero modulation).
Everything else is ComfyUI's own `forward_orig`, whole, and the reason is reported.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...host import call_arguments
from ...integrations.comfyui.host import (
    ComfyHost,
    View,
    checked_attention,
    flux_math_unpatched,
    rope_rotation,
)
from ...ops import qk_norm_rope
from ..common import HostRope, activation_plain, feed_forward_plain, layer_norms_plain
from ..deferral import Fusion, PendingConcat, Stream, materialize, stream_rows
from .blocks import DOUBLE_NORMS, double_block_body, single_block_body

# `Flux.forward_orig`'s parameters in order, with defaults (the first is named as the block code's
# `call_arguments` expects it).
PARAMETERS = {
    "hidden_states": None,
    "img_ids": None,
    "txt": None,
    "txt_ids": None,
    "timesteps": None,
    "y": None,
    "guidance": None,
    "control": None,
    "timestep_zero_index": None,
    "transformer_options": {},
    "attn_mask": None,
}
# Transformer-option patches ComfyUI's FLUX model applies: any of them hands the call to ComfyUI.
FLUX_PATCHES = ("post_input", "attn1_patch", "attn1_output_patch")


def make_host() -> ComfyHost:
    """The host for ComfyUI's FLUX classes (imports ComfyUI's FLUX and ops modules)."""
    from comfy import ops
    from comfy.ldm.flux import layers

    classes = {
        layers.DoubleStreamBlock,
        layers.SingleStreamBlock,
        layers.QKNorm,
        layers.Modulation,
        layers.LastLayer,
        layers.SiLUActivation,
    }
    return ComfyHost(frozenset(classes), ops.disable_weight_init.LayerNorm, ops.disable_weight_init.RMSNorm)


def saturate(x: torch.Tensor) -> torch.Tensor:
    """ComfyUI's fp16 saturation of a stream: NaN to 0, the infinities to +-65504."""
    return torch.nan_to_num(x, nan=0.0, posinf=65504.0, neginf=-65504.0)


def make_fusion(fused: bool = True) -> Fusion:
    """The switch and streams of a ComfyUI model: ComfyUI's modulation rounding and saturation."""
    return Fusion(fused, addcmul=True, saturate=saturate)


def _mlp_view(mlp: nn.Module) -> View:
    """An MLP, `Sequential(Linear, activation, Linear)` (FLUX.2: `SiLUActivation`; FLUX.1: a tanh
    `nn.GELU`), under diffusers' `Flux2FeedForward` names."""
    return View((mlp,), linear_in=mlp[0], act_fn=mlp[1], linear_out=mlp[2])


def double_view(block: nn.Module) -> View:
    """A `DoubleStreamBlock` under diffusers' `Flux2TransformerBlock` names."""
    img, txt = block.img_attn, block.txt_attn
    attn = View(
        (img.norm, txt.norm),  # `SelfAttention` has no forward: its q/k norms are what is replaced
        fused_projections=True,
        head_dim=block.hidden_size // block.num_heads,
        to_qkv=img.qkv,
        to_added_qkv=txt.qkv,
        norm_q=img.norm.query_norm,
        norm_k=img.norm.key_norm,
        norm_added_q=txt.norm.query_norm,
        norm_added_k=txt.norm.key_norm,
        to_out=(img.proj,),
        to_add_out=txt.proj,
    )
    return View(
        (block,),
        modulation=getattr(block, "img_mod", None),  # FLUX.1's own; FLUX.2's blocks have none
        modulation_context=getattr(block, "txt_mod", None),
        norm1=block.img_norm1,
        norm1_context=block.txt_norm1,
        norm2=block.img_norm2,
        norm2_context=block.txt_norm2,
        attn=attn,
        ff=_mlp_view(block.img_mlp),
        ff_context=_mlp_view(block.txt_mlp),
    )


def single_view(block: nn.Module) -> View:
    """A `SingleStreamBlock` under diffusers' `Flux2SingleTransformerBlock` names."""
    attn = View(
        (block.norm,),
        head_dim=block.hidden_size // block.num_heads,
        inner_dim=block.hidden_size,
        mlp_hidden_dim=block.mlp_hidden_dim,
        mlp_mult_factor=block.mlp_hidden_dim_first // block.mlp_hidden_dim,
        to_qkv_mlp_proj=block.linear1,
        to_out=block.linear2,
        norm_q=block.norm.query_norm,
        norm_k=block.norm.key_norm,
        mlp_act_fn=block.mlp_act,
    )
    return View((block,), modulation=block.modulation, norm=block.pre_norm, attn=attn)


def _variant(model: nn.Module) -> str | None:
    """ "flux2" (modulation computed once for all blocks, SiLU-gated MLPs), "flux1" (each block's own
    modulation, tanh-GELU MLPs), None for ComfyUI's other FLUX variants (yak MLPs, mixed settings)."""
    params = model.params
    if params.yak_mlp or params.global_modulation != params.mlp_silu_act:
        return None
    return "flux2" if params.global_modulation else "flux1"


def model_reason(model: nn.Module, options: dict[str, Any]) -> str | None:
    """Why the block code cannot run this model with these transformer options, whatever its
    blocks hold (see the module docstring); None where it can."""
    patches = options.get("patches") or {}
    if _variant(model) is None:
        return "not a FLUX.1 or FLUX.2 model (other FLUX variants run ComfyUI's own forward)"
    if any(patches.get(name) for name in FLUX_PATCHES):
        return (
            f"transformer patches from other nodes ({', '.join(n for n in FLUX_PATCHES if patches.get(n))})"
        )
    if (options.get("patches_replace") or {}).get("dit"):
        return "block replacements from other nodes"
    if type(model.double_blocks) is not nn.ModuleList or type(model.single_blocks) is not nn.ModuleList:
        return "the block lists are not PyTorch ModuleLists"
    if not flux_math_unpatched():
        return "ComfyUI's FLUX attention or RoPE function is replaced"
    if "optimized_attention_override" in options:
        return "an attention override is set in the transformer options"
    if not checked_attention():
        return (
            "ComfyUI's attention is an attention library's (sage, flash-attn, xformers), which the "
            "node has not checked with its q, k, v layout"
        )
    return None


def views_of(model: nn.Module) -> tuple[list[View], list[View]] | None:
    """The blocks' views, None where a block does not hold what ComfyUI's FLUX blocks hold (a tool
    swapped a submodule for another kind)."""
    try:
        return [double_view(b) for b in model.double_blocks], [single_view(b) for b in model.single_blocks]
    except (AttributeError, TypeError, IndexError):
        return None


def blocks_reason(
    model: nn.Module, host: ComfyHost, views: tuple[list[View], list[View]], options: dict[str, Any]
) -> str | None:
    """Why the block code cannot run these blocks (given their views), the modulations or the output
    layer; None where it can."""
    doubles, singles = views
    for view in doubles:
        if not (
            host.plain(view)
            and layer_norms_plain(host, view, DOUBLE_NORMS)
            and host.attention(view.attn, options, 0) is not None
            and feed_forward_plain(host, view.ff)
            and feed_forward_plain(host, view.ff_context)
        ):
            return "a double block is hooked, patched or holds modules of other classes"
    for view in singles:
        attn = view.attn
        if not (
            host.plain(view)
            and layer_norms_plain(host, view, ("norm",))
            and host.attention(attn, options, 0) is not None
            and activation_plain(host, attn.mlp_act_fn)
        ):
            return "a single block is hooked, patched or holds modules of other classes"
    if _variant(model) == "flux2":
        modulations = [
            model.double_stream_modulation_img,
            model.double_stream_modulation_txt,
            model.single_stream_modulation,
        ]
    else:
        modulations = [m for view in doubles for m in (view.modulation, view.modulation_context)]
        modulations += [view.modulation for view in singles]
    final = model.final_layer
    if not all(mod is not None and host.plain(mod) for mod in modulations):
        return "a modulation is hooked or patched"
    if not (host.plain(final) and layer_norms_plain(host, final, ("norm_final",))):
        return "the output layer is hooked, patched or holds modules of other classes"
    return None


def host_rope(pe: torch.Tensor, dtype: torch.dtype) -> HostRope:
    """The block code's RoPE for ComfyUI's rotation matrices pe [B, 1, S, hd/2, 2, 2] and q, k of
    `dtype`: where one of the fused prologue's rotations computes ComfyUI's `apply_rope` on this
    installation (`rope_rotation`: comfy-kitchen's CUDA kernel, or torch's ops), that rotation with
    pe's entries as tables; ComfyUI's own `apply_rope` on the [B, H, S, hd] views its blocks rotate
    wherever the prologue does not launch (docs/numerics.md, 12)."""
    from comfy.ldm.flux.math import apply_rope

    def rotate(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = apply_rope(query.transpose(1, 2), key.transpose(1, 2), pe)
        return q.transpose(1, 2), k.transpose(1, 2)

    rotation = rope_rotation(dtype, pe)
    tables = () if rotation is None else qk_norm_rope.reference.comfy_tables(pe)
    return HostRope(tables, rotate, rotation)


def _modulation(module: nn.Module, host: ComfyHost, vec: torch.Tensor) -> torch.Tensor:
    """The [B, 1, 3*sets*D] projection ComfyUI's `Modulation` chunks: its Linear on silu(vec)."""
    return host.linear(module.lin, F.silu(vec[:, None, :] if vec.ndim == 2 else vec))


def call_reason(settings: dict[str, Any] | None) -> str | None:
    """Why the block code does not implement this `forward_orig` call's arguments; None where it does."""
    if settings is None:
        return "arguments forward_orig does not take"
    given = [name for name in ("control", "timestep_zero_index", "attn_mask") if settings[name] is not None]
    if given:
        return f"{', '.join(given)} given (ControlNet, per-token timestep-zero modulation, masks)"
    img, txt = settings["hidden_states"], settings["txt"]
    if settings["img_ids"] is None or not all(
        isinstance(t, torch.Tensor) and t.ndim == 3 for t in (img, txt)
    ):
        return "no image ids, or image and text rows that are not [B, S, D]"
    return None


def forward_orig(
    model: nn.Module, host: ComfyHost, fusion: Fusion, args: tuple, kwargs: dict
) -> tuple[torch.Tensor | None, str | None]:
    """ComfyUI's `Flux.forward_orig` on the block code: (its output, None), or (None, why) where
    ComfyUI's own must run the call."""
    settings = call_arguments(PARAMETERS, args, kwargs)
    reason = call_reason(settings)
    if reason is not None:
        return None, reason
    assert settings is not None
    options = dict(settings["transformer_options"] or {})
    reason = model_reason(model, options)
    if reason is not None:
        return None, reason
    views = views_of(model)
    if views is None:
        return None, "a block holds modules of other kinds than ComfyUI's FLUX blocks"
    reason = blocks_reason(model, host, views, options)
    if reason is not None:
        return None, reason
    return _blocks(model, host, fusion, views, settings, options), None


def _blocks(
    model: nn.Module,
    host: ComfyHost,
    fusion: Fusion,
    views: tuple[list[View], list[View]],
    settings: dict[str, Any],
    options: dict[str, Any],
) -> torch.Tensor:
    """ComfyUI's `forward_orig` from the embeddings to the output layer, in its order: the modules
    it calls are called (ComfyUI's own timestep embedding), the blocks run on the block code."""
    from comfy.ldm.flux.layers import timestep_embedding

    params = model.params
    img, txt = settings["hidden_states"], settings["txt"]
    x = host.linear(model.img_in, img)
    vec = host.call(model.time_in, timestep_embedding(settings["timesteps"], 256).to(x.dtype))
    guidance = settings["guidance"]
    if params.guidance_embed and guidance is not None:
        vec = vec + host.call(model.guidance_in, timestep_embedding(guidance, 256).to(x.dtype))
    if model.vector_in is not None:
        y = settings["y"]
        if y is None:
            y = torch.zeros((x.shape[0], params.vec_in_dim), device=x.device, dtype=x.dtype)
        vec = vec + host.call(model.vector_in, y[:, : params.vec_in_dim])
    if model.txt_norm is not None:
        txt = host.call(model.txt_norm, txt)
    c: Stream = host.linear(model.txt_in, txt)
    ids = torch.cat((settings["txt_ids"], settings["img_ids"]), dim=1)
    rope = host_rope(host.call(model.pe_embedder, ids), x.dtype)
    shared = _variant(model) == "flux2"
    if shared:
        mod_img = _modulation(model.double_stream_modulation_img, host, vec)
        mod_txt = _modulation(model.double_stream_modulation_txt, host, vec)
    text_tokens = txt.shape[1]
    doubles, singles = views
    stream: Stream = x
    options.update(total_blocks=len(doubles), block_type="double")
    for i, view in enumerate(doubles):
        options["block_index"] = i
        if not shared:
            mod_img = _modulation(view.modulation, host, vec)
            mod_txt = _modulation(view.modulation_context, host, vec)
        stream, c = double_block_body(view, host, fusion, stream, c, mod_img, mod_txt, rope, options)
    if x.dtype == torch.float16:
        stream = fusion.saturate(materialize(stream))
    h: Stream = PendingConcat(c, stream)
    if shared:
        mod_single = _modulation(model.single_stream_modulation, host, vec)
    options.update(
        total_blocks=len(singles), block_type="single", img_slice=[text_tokens, text_tokens + x.shape[1]]
    )
    for i, view in enumerate(singles):
        options["block_index"] = i
        if not shared:
            mod_single = _modulation(view.modulation, host, vec)
        h = single_block_body(view, host, fusion, h, mod_single, rope, options, text_tokens)
    final = model.final_layer
    shift, scale = host.call(final.adaLN_modulation, vec[:, None, :]).chunk(2, dim=-1)
    out = fusion.output_norm(stream_rows(h, text_tokens), scale, shift, final.norm_final.eps)
    return host.linear(final.linear, out)
