"""The FLUX.1 family in the benchmarks: diffusers' FluxTransformer2DModel with random weights, one
step's inputs, and a FluxPipeline of random components around it.

FLUX.1 has no model of the package's own, so its benchmarks run on the diffusers host only; the
setups (LoRA, offload, quantization) are `bench.hosts`' own, applied to this transformer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..models.flux1 import flux1_config, image_ids, text_ids
from . import hosts

# The Linears a FLUX.1 LoRA adapts, by the ends of their names inside the blocks: the attention
# projections FLUX.2's share, the feed-forwards' two Linears, the single block's MLP input and output
# projection.
LORA_TARGETS = (*hosts.ATTENTION_TARGETS, "net.0.proj", "net.2", "proj_mlp", "proj_out")


def random_transformer(
    name: str, device: torch.device, dtype: torch.dtype, seed: int = 0, **overrides: Any
) -> nn.Module:
    """diffusers' FluxTransformer2DModel of a FLUX1_PRESETS size (constructor arguments `overrides`
    changed, e.g. fewer blocks for the tests), as `hosts.random_transformer` makes it."""
    from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel

    return hosts.random_transformer(
        FluxTransformer2DModel, {**flux1_config(name), **overrides}, device, dtype, seed
    )


def step_inputs(
    name: str,
    batch: int,
    img_tokens: int,
    txt_tokens: int,
    dtype: torch.dtype,
    seed: int = 1,
    width_tokens: int | None = None,
) -> dict[str, Any]:
    """Random latents, text embeddings and pooled text embedding from `seed`, FLUX.1's position ids
    of an image `width_tokens` wide (default: square), a timestep and (dev) the guidance, on the GPU."""
    config = flux1_config(name)
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    return {
        "hidden_states": randn(batch, img_tokens, config.get("in_channels", 64)),
        "encoder_hidden_states": randn(batch, txt_tokens, config.get("joint_attention_dim", 4096)),
        "pooled_projections": randn(batch, config.get("pooled_projection_dim", 768)),
        "timestep": torch.full((batch,), 0.5, device="cuda"),
        "img_ids": image_ids(img_tokens, width_tokens, device="cuda"),
        "txt_ids": text_ids(txt_tokens, device="cuda"),
        "guidance": torch.full((batch,), 3.5, device="cuda") if config.get("guidance_embeds") else None,
    }


def pipeline(transformer: nn.Module, seed: int = 0, cls: type | None = None) -> Any:
    """A FluxPipeline (or another FLUX.1 pipeline class `cls` taking the same components, e.g.
    FluxKontextPipeline) around `transformer`: FLUX.1's AutoencoderKL (16 latent channels, its published
    config) with random weights on the transformer's device and dtype, diffusers' default
    FlowMatchEulerDiscreteScheduler, no text encoders (callers pass prompt and pooled embeddings).
    The progress bar is off."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline

    vae = hosts.random_vae(
        AutoencoderKL,
        transformer,
        seed,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512),
        layers_per_block=2,
        latent_channels=16,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    pipe = (cls or FluxPipeline)(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def prompt_embeddings(transformer: nn.Module, txt_tokens: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """Fixed random prompt and pooled prompt embeddings for a FluxPipeline call."""
    weight = next(transformer.parameters())
    config = transformer.config
    gen = torch.Generator().manual_seed(seed)
    embeds = torch.randn(1, txt_tokens, config.joint_attention_dim, generator=gen)
    pooled = torch.randn(1, config.pooled_projection_dim, generator=gen)
    return {
        "prompt_embeds": embeds.to(weight.device, weight.dtype),
        "pooled_prompt_embeds": pooled.to(weight.device, weight.dtype),
    }
