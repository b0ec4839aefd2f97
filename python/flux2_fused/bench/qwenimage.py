"""The Qwen-Image family in the benchmarks: diffusers' QwenImageTransformer2DModel with random weights
and one step's inputs as `QwenImagePipeline` hands them to it.

Qwen-Image has no model of the package's own, so its benchmarks run on the diffusers host only; the
setups (LoRA, offload, quantization) are `bench.hosts`' own, applied to this transformer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..errors import BadValue
from . import hosts

# The published size is the class's default (60 blocks, D = 24 heads x 128, 20 B parameters); the
# input widths the step's inputs need are written out.
QWEN_IMAGE_PRESETS: dict[str, dict[str, Any]] = {
    "qwen-image": {"in_channels": 64, "joint_attention_dim": 3584}
}
# The Linears a Qwen-Image LoRA adapts, by the ends of their names inside the blocks: the attention
# projections, the MLPs' two Linears, the modulations' Linear.
LORA_TARGETS = (*hosts.ATTENTION_TARGETS, "net.0.proj", "net.2", "img_mod.1", "txt_mod.1")


def random_transformer(
    name: str, device: torch.device, dtype: torch.dtype, seed: int = 0, **overrides: Any
) -> nn.Module:
    """diffusers' QwenImageTransformer2DModel of a QWEN_IMAGE_PRESETS size (constructor arguments
    `overrides` changed), as `hosts.random_transformer` makes it."""
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

    return hosts.random_transformer(
        QwenImageTransformer2DModel, {**QWEN_IMAGE_PRESETS[name], **overrides}, device, dtype, seed
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
    """Random packed latents and text features from `seed` on the GPU, the image's shape in tokens
    (`width_tokens` wide, default square) and a timestep. No text mask: the pipeline drops one that
    masks nothing, as every token of a benchmark's text is valid."""
    width = width_tokens or math.isqrt(img_tokens)
    if img_tokens % width:
        raise BadValue(f"Qwen-Image lays {img_tokens} image tokens out {width} wide: not a rectangle")
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    config = QWEN_IMAGE_PRESETS[name]
    return {
        "hidden_states": randn(batch, img_tokens, config["in_channels"]),
        "encoder_hidden_states": randn(batch, txt_tokens, config["joint_attention_dim"]),
        "encoder_hidden_states_mask": None,
        "timestep": torch.full((batch,), 0.5, device="cuda", dtype=dtype),
        "img_shapes": [[(1, img_tokens // width, width)]] * batch,
    }
