"""Tiny FLUX.3 components for the tests: diffusers' Flux3Transformer2DModel at the `flux3-tiny` size
(random weights, its q/k norms kept in fp32 as `from_pretrained` keeps them) and one step's inputs."""

from __future__ import annotations

from typing import Any

import torch

from flux2_fused.models.flux3 import blocks, flux3_config, image_ids, text_ids

TINY = flux3_config("flux3-tiny")
FAMILY = blocks  # for count_block_code


def transformer(seed: int = 1, dtype: torch.dtype = torch.float32, **overrides: Any) -> torch.nn.Module:
    """The tiny FLUX.3 transformer with diffusers' default init from `seed`, in eval mode, in
    `dtype` but for the q/k norms, which stay fp32 as diffusers loads them."""
    from diffusers.models.transformers.transformer_flux3 import Flux3Transformer2DModel

    torch.manual_seed(seed)
    model = Flux3Transformer2DModel(**{**TINY, **overrides}).eval().to(dtype)
    for name, module in model.named_modules():
        if name.endswith(("norm_q", "norm_k")):
            module.float()
    return model


def step_inputs(
    batch: int = 2,
    rows: int = 3,
    cols: int = 3,
    txt_tokens: int = 5,
    references: int = 0,
    dtype: torch.dtype = torch.float32,
    seed: int = 3,
    flow_map: bool = False,
) -> dict[str, Any]:
    """One step's arguments; `references` reference images of rows x cols tokens each."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    inputs = {
        "hidden_states": randn(batch, rows * cols, TINY["in_channels"]),
        "encoder_hidden_states": randn(batch, txt_tokens, TINY["joint_attention_dim"]),
        "timestep": torch.full((batch,), 0.7, dtype=dtype),
        "img_ids": image_ids(rows, cols),
        "txt_ids": text_ids(txt_tokens),
    }
    if references:
        inputs["image_cond_hidden_states"] = randn(batch, references * rows * cols, TINY["cond_in_channels"])
        inputs["image_cond_ids"] = torch.cat(
            [image_ids(rows, cols, reference=i + 1) for i in range(references)]
        )
    if flow_map:
        inputs["target_timestep"] = torch.full((batch,), 0.4, dtype=dtype)
    return inputs
