"""FLUX.3 sizes as diffusers' `Flux3Transformer2DModel` arguments, and the pipelines' position ids.

Like FLUX.1, the family has no model of its own: diffusers' transformer is its host, so a size is
the keyword arguments diffusers' constructor takes (`Flux3Transformer2DModel(**flux3_config(name))`).
"""

from __future__ import annotations

from typing import Any

import torch

# FLUX.3 [klein] is the class's default (5 mode blocks a mode, 28 joint blocks, D = 24 heads x 128,
# Qwen3-VL text features of 20480 channels); `flux3-klein-flow` its step-distilled (flow-map) form;
# `flux3-tiny` a size for CPU tests; `flux3-small` a small one at which every fused op runs on a GPU
# (head_dim 128, D a multiple of 4).
FLUX3_PRESETS: dict[str, dict[str, Any]] = {
    "flux3-klein": {},
    "flux3-klein-flow": {"flow_map": True},
    "flux3-tiny": {
        "in_channels": 16,
        "cond_in_channels": 16,
        "num_layers": 2,
        "num_single_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 24,
        "timestep_channels": 32,
        "axes_dims_rope": (4, 4, 4, 4),
    },
    "flux3-small": {
        "in_channels": 64,
        "cond_in_channels": 64,
        "num_layers": 2,
        "num_single_layers": 2,
        "num_attention_heads": 2,
        "joint_attention_dim": 96,
    },
}
# The pipelines scale the image rows' h and w position ids by this (diffusers' `image_rope_scale`).
IMAGE_ROPE_SCALE = 0.5


def flux3_config(name: str) -> dict[str, Any]:
    """The diffusers constructor arguments of a named FLUX.3 size (FLUX3_PRESETS)."""
    if name not in FLUX3_PRESETS:
        raise ValueError(f"unknown FLUX.3 preset {name!r}; choose one of {sorted(FLUX3_PRESETS)}")
    return dict(FLUX3_PRESETS[name])


def image_ids(rows: int, cols: int, reference: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """Position ids (t, h, w, l) of a rows x cols latent grid, row by row, as FLUX.3's pipelines make
    them: t = 0, h and w scaled by IMAGE_ROPE_SCALE, l = 0 for the generated image and -1, -2, ...
    for the `reference`-th reference image (1-based)."""
    h, w = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    ids = torch.zeros(rows * cols, 4)
    ids[:, 1] = h.flatten() * IMAGE_ROPE_SCALE
    ids[:, 2] = w.flatten() * IMAGE_ROPE_SCALE
    ids[:, 3] = -reference
    return ids.to(device)


def text_ids(tokens: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Text position ids (0, 0, 0, i): text advances along the l axis."""
    ids = torch.zeros(tokens, 4)
    ids[:, 3] = torch.arange(tokens)
    return ids.to(device)
