"""FLUX.2 as sglang writes it: its `Flux2Transformer2DModel` (sglang 0.5's diffusion runtime) on the
family's block code.

sglang's DiT has diffusers' parameter names and, on the CPU, diffusers' arithmetic; what its forward
takes differs, and this module maps it:
- the timestep arrives already x1000 (sglang's pipeline scales it), and is only cast to the input's
  dtype; guidance is cast and x1000 as in diffusers;
- the RoPE tables arrive as `freqs_cis`, sglang's half-width (cos, sin) over the joint text-then-image
  rows; each column repeated twice is diffusers' full-width table, value for value;
- each `Flux2Modulation` returns (shift, scale, gate) chunks of silu(temb) @ W; the block code takes the
  projection itself, the same tensor;
- `joint_attention_kwargs`: sglang drops a LoRA "scale"; other keys go to sglang's own forward.
A call runs on the block code only where the block code can do all of it (`runs_whole`): one rank (no
tensor or sequence parallelism), an unquantized model (sglang's FP8/NVFP4 paths fuse quantization
into its norms), the block lists PyTorch's own `ModuleList`s (a cache such as cache-dit replaces them
with containers that decide which blocks run), every block, attention, feed-forward and norm plain
for the host, the RoPE tables given. Everything else is sglang's own forward, whole: a call is never
part ours, part sglang's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...host import call_arguments
from ...integrations.sglang.host import SglangHost
from ..common import Rope, activation_plain, feed_forward_plain, output_norm_plain, qk_norms
from ..deferral import Fusion
from .blocks import (
    Conditioning,
    double_block_plain,
    single_block_plain,
    transformer,
)

# sglang's forward's parameters in order, with defaults.
PARAMETERS = {
    "hidden_states": None,
    "encoder_hidden_states": None,
    "timestep": None,
    "guidance": None,
    "freqs_cis": None,
    "joint_attention_kwargs": None,
}


def make_host() -> SglangHost:
    """The host for sglang's FLUX.2 classes (imports sglang's DiT module)."""
    from diffusers.models.normalization import AdaLayerNormContinuous
    from sglang.multimodal_gen.runtime.layers.layernorm import RMSNorm
    from sglang.multimodal_gen.runtime.models.dits import flux_2

    blocks = {
        flux_2.Flux2TransformerBlock,
        flux_2.Flux2SingleTransformerBlock,
        flux_2.Flux2Attention,
        flux_2.Flux2ParallelSelfAttention,
    }
    others = {flux_2.Flux2FeedForward, flux_2.Flux2SwiGLU, flux_2.Flux2Modulation, AdaLayerNormContinuous}
    return SglangHost(frozenset(blocks | others), RMSNorm, frozenset(blocks))


def _one_rank() -> bool:
    from sglang.multimodal_gen.runtime.distributed import get_sp_world_size, get_tp_world_size

    return get_tp_world_size() == 1 and get_sp_world_size() == 1


def _attention_runs(attn: nn.Module, host: SglangHost, norms: tuple[str, ...]) -> bool:
    """The block code can run this attention module whole: the host has its attention, and the
    prologue fuses its q/k norms (`norms`) rather than calling them."""
    return host.attention(attn, None, 0) is not None and (
        qk_norms(host, (getattr(attn, name) for name in norms)) is not None
    )


def runs_whole(model: nn.Module, host: SglangHost) -> bool:
    """Whether the block code can run all of this model's call (see the module docstring): every
    dispatcher of the block code would take its body, so none of its fallbacks (which pass diffusers'
    arguments) is reached."""
    if (
        getattr(model, "quant_config", None) is not None
        or not _one_rank()
        # A cache (cache-dit) swaps the block lists for containers that decide which blocks run.
        or type(model.transformer_blocks) is not nn.ModuleList
        or type(model.single_transformer_blocks) is not nn.ModuleList
    ):
        return False
    double_norms = ("norm_added_q", "norm_q", "norm_added_k", "norm_k")
    if not all(
        double_block_plain(host, block)
        and _attention_runs(block.attn, host, double_norms)
        # Their inputs are strided rows of the joint output at batch > 1 (see SglangHost.linear).
        and block.attn.to_out[0].bias is None
        and block.attn.to_add_out.bias is None
        and feed_forward_plain(host, block.ff)
        and feed_forward_plain(host, block.ff_context)
        for block in model.transformer_blocks
    ):
        return False
    if not all(
        single_block_plain(host, block)
        and _attention_runs(block.attn, host, ("norm_q", "norm_k"))
        and activation_plain(host, block.attn.mlp_act_fn)
        for block in model.single_transformer_blocks
    ):
        return False
    modulations = (
        model.double_stream_modulation_img,
        model.double_stream_modulation_txt,
        model.single_stream_modulation,
    )
    return all(host.plain(mod) and host.plain(mod.act_fn) for mod in modulations) and output_norm_plain(
        host, model.norm_out
    )


def full_width_rope(freqs_cis: tuple[torch.Tensor, torch.Tensor]) -> Rope:
    """diffusers' (cos, sin) tables from sglang's half-width ones: each column twice, in fp32."""
    return tuple(t.float().repeat_interleave(2, dim=-1) for t in freqs_cis)  # type: ignore[return-value]


def _modulation(module: nn.Module, host: SglangHost, temb: torch.Tensor) -> torch.Tensor:
    """The [B, 3*sets*D] projection `Flux2Modulation` chunks: its Linear on its SiLU of temb."""
    return host.linear(module.linear, module.act_fn(temb))


def forward(model: nn.Module, host: SglangHost, fusion: Fusion, args: tuple, kwargs: dict) -> Any:
    """sglang's `Flux2Transformer2DModel.forward` on the block code; None where sglang's own forward
    must run the call (see the module docstring)."""
    settings = call_arguments(PARAMETERS, args, kwargs)
    if settings is None:
        return None
    hidden_states, encoder_hidden_states = settings["hidden_states"], settings["encoder_hidden_states"]
    timestep, freqs_cis, extra = (
        settings["timestep"],
        settings["freqs_cis"],
        settings["joint_attention_kwargs"],
    )
    if (
        encoder_hidden_states is None
        or timestep is None
        or not isinstance(freqs_cis, tuple | list)
        or len(freqs_cis) != 2
        or (extra is not None and set(extra) - {"scale"})
        or not runs_whole(model, host)
    ):
        return None
    dtype = hidden_states.dtype
    timestep = timestep.to(dtype)
    guidance = settings["guidance"]
    if guidance is not None:
        guidance = guidance.to(dtype) * 1000
    temb = host.call(model.time_guidance_embed, timestep, guidance)
    cond = Conditioning(
        timestep=timestep,
        guidance=guidance,
        temb=temb,
        mod_img=_modulation(model.double_stream_modulation_img, host, temb),
        mod_txt=_modulation(model.double_stream_modulation_txt, host, temb),
        mod_single=_modulation(model.single_stream_modulation, host, temb),
        x=host.linear(model.x_embedder, hidden_states),
        c=host.linear(model.context_embedder, encoder_hidden_states),
        rope=full_width_rope(freqs_cis),
    )
    return transformer(model, host, fusion, cond, leading_rows=encoder_hidden_states.shape[1])
