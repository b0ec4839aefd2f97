"""The FLUX.3 family in the benchmarks: diffusers' Flux3Transformer2DModel with random weights (its
q/k norms in fp32, as `from_pretrained` keeps them) and one step's inputs.

FLUX.3 has no model of the package's own, so its benchmarks run on the diffusers host only; the
setups (LoRA, offload, quantization) are `bench.hosts`' own, applied to this transformer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..models.flux3 import flux3_config, image_ids, text_ids
from . import hosts

# The Linears a FLUX.3 LoRA adapts: every block's q, k, v and output projections and its MLP.
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "linear_in", "linear_out")


def random_transformer(
    name: str, device: torch.device, dtype: torch.dtype, seed: int = 0, **overrides: Any
) -> nn.Module:
    """diffusers' Flux3Transformer2DModel of a FLUX3_PRESETS size (constructor arguments `overrides`
    changed), as `hosts.random_transformer` makes it, with its q/k norms moved to fp32 as diffusers'
    loader keeps them (`_keep_in_fp32_modules`)."""
    from diffusers.models.transformers.transformer_flux3 import Flux3Transformer2DModel

    model = hosts.random_transformer(
        Flux3Transformer2DModel, {**flux3_config(name), **overrides}, device, dtype, seed
    )
    for module_name, module in model.named_modules():
        if module_name.rsplit(".", 1)[-1] in Flux3Transformer2DModel._keep_in_fp32_modules:
            module.float()
    return model


def step_inputs(
    name: str,
    batch: int,
    img_tokens: int,
    txt_tokens: int,
    dtype: torch.dtype,
    seed: int = 1,
    width_tokens: int | None = None,
    reference_tokens: int = 0,
) -> dict[str, Any]:
    """Random latents and text features from `seed`, FLUX.3's position ids of an image `width_tokens`
    wide (default: square), the timestep (and the flow map's target timestep), on the GPU; with
    `reference_tokens`, one reference image of that many tokens, as wide as the image."""
    config = flux3_config(name)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cols = width_tokens or max(1, round(img_tokens**0.5))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    def grid(tokens: int, reference: int = 0) -> torch.Tensor:
        return image_ids(-(-tokens // cols), cols, reference=reference, device="cuda")[:tokens]

    inputs = {
        "hidden_states": randn(batch, img_tokens, config.get("in_channels", 128)),
        "encoder_hidden_states": randn(batch, txt_tokens, config.get("joint_attention_dim", 20480)),
        "timestep": torch.full((batch,), 0.5, device="cuda", dtype=dtype),
        "img_ids": grid(img_tokens),
        "txt_ids": text_ids(txt_tokens, device="cuda"),
    }
    if reference_tokens:
        inputs["image_cond_hidden_states"] = randn(
            batch, reference_tokens, config.get("cond_in_channels", 128)
        )
        inputs["image_cond_ids"] = grid(reference_tokens, reference=1)
    if config.get("flow_map"):
        inputs["target_timestep"] = torch.full((batch,), 0.25, device="cuda", dtype=dtype)
    return inputs
