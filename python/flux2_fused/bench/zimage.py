"""The Z-Image family in the benchmarks: diffusers' ZImageTransformer2DModel with random weights and one
step's inputs as `ZImagePipeline` hands them to it.

Z-Image has no model of the package's own, so its benchmarks run on the diffusers host only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..errors import BadValue
from . import hosts

# Z-Image-Turbo's published size is the class's default (30 main layers and two refiners of each kind,
# D = 30 heads x 128, 16 latent channels, 2560-wide caption features, about 6 B parameters).
Z_IMAGE_PRESETS: dict[str, dict[str, Any]] = {"z-image-turbo": {}}
CAPTION_FEATURES = 2560  # the default config's cap_feat_dim
LATENT_CHANNELS = 16
# The Linears a Z-Image LoRA adapts, by the ends of their names inside the blocks: the attention
# projections, the feed-forwards' three Linears, the modulation's Linear.
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3", "adaLN_modulation.0")


def random_transformer(
    name: str, device: torch.device, dtype: torch.dtype, seed: int = 0, **overrides: Any
) -> nn.Module:
    """diffusers' ZImageTransformer2DModel of a Z_IMAGE_PRESETS size (constructor arguments `overrides`
    changed), as `hosts.random_transformer` makes it."""
    from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel

    return hosts.random_transformer(
        ZImageTransformer2DModel, {**Z_IMAGE_PRESETS[name], **overrides}, device, dtype, seed
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
    """Random latents (one [16, 1, H, W] a sample, 2x2 latent pixels a token, `width_tokens` wide,
    default square) and caption features ([txt_tokens, 2560] a sample) from `seed` on the GPU, and a
    timestep, as lists the way the pipeline passes them."""
    width = width_tokens or math.isqrt(img_tokens)
    if img_tokens % width:
        raise BadValue(f"Z-Image lays {img_tokens} image tokens out {width} wide: not a rectangle")
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    height = img_tokens // width
    return {
        "x": [randn(LATENT_CHANNELS, 1, 2 * height, 2 * width) for _ in range(batch)],
        "t": torch.full((batch,), 0.5, device="cuda", dtype=dtype),
        "cap_feats": [randn(txt_tokens, CAPTION_FEATURES) for _ in range(batch)],
    }
