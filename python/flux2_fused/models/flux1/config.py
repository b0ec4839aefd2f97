"""FLUX.1 sizes as diffusers' `FluxTransformer2DModel` arguments, and the pipelines' position ids.

The family has no model of its own: diffusers' transformer is its one host, so a configuration is
the keyword arguments diffusers' constructor takes (`FluxTransformer2DModel(**FLUX1_PRESETS[name])`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

# The published FLUX.1 sizes (12B: 19 double and 38 single blocks, D = 24 heads x 128), and a tiny one
# for tests. dev and Kontext embed the guidance scale; schnell does not.
FLUX1_PRESETS: dict[str, dict[str, Any]] = {
    "flux1-dev": {"guidance_embeds": True},
    "flux1-schnell": {"guidance_embeds": False},
    "flux1-tiny": {
        "num_layers": 2,
        "num_single_layers": 3,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 24,
        "pooled_projection_dim": 12,
        "in_channels": 16,
        "guidance_embeds": True,
        "axes_dims_rope": (4, 6, 6),
    },
}


def flux1_config(name: str) -> dict[str, Any]:
    """The diffusers constructor arguments of a named FLUX.1 size (FLUX1_PRESETS)."""
    if name not in FLUX1_PRESETS:
        raise ValueError(f"unknown FLUX.1 preset {name!r}; choose one of {sorted(FLUX1_PRESETS)}")
    return dict(FLUX1_PRESETS[name])


def image_ids(tokens: int, width: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """FLUX.1 pipeline position ids (0, row, col) of `tokens` latent tokens laid out row by row,
    `width` tokens a row (default: the smallest square grid that holds them), as float, as
    `FluxPipeline._prepare_latent_image_ids` makes them."""
    width = width or math.isqrt(max(tokens - 1, 0)) + 1
    index = torch.arange(tokens, device=device)
    return torch.stack([torch.zeros_like(index), index // width, index % width], dim=-1).float()


def text_ids(tokens: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """FLUX.1 pipeline text position ids: all zero, [tokens, 3]."""
    return torch.zeros(tokens, 3, device=device)
