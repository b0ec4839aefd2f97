"""Tiny FLUX.3 components for the tests: diffusers' Flux3Transformer2DModel at the `flux3-tiny` size
(random weights, its q/k norms kept in fp32 as `from_pretrained` keeps them), one step's inputs, a
reference image and a modular pipeline call, and how many fused launches a call makes."""

from __future__ import annotations

from typing import Any

import torch

from flux2_fused.models.flux3 import blocks, flux3_config, image_ids, text_ids

TINY = flux3_config("flux3-tiny")
FAMILY = blocks  # for count_block_code
PIPELINE_STEPS = 2
# A mode block's sites: its modulated norm, its q/k prologue, its SwiGLU; a joint single block's: its
# twin norms (one launch), its prologue, its SwiGLU; the output norm once. And the proofs of equal
# modulation rows: each mode stack's, the text rows' and (without a reference image) the content
# rows' for the joint blocks.
MODE_BLOCK_SITES = 3
SINGLE_BLOCK_SITES = 3


def fused_sites(model: torch.nn.Module, references: bool) -> int:
    """Our launches in one call of a FLUX.3 transformer with every site fused: each mode (text,
    image, and the reference image's with `references`) runs the mode blocks."""
    modes = 3 if references else 2
    mode_blocks = modes * len(model.txt_mode_blocks)
    proofs = modes + (1 if references else 2)
    blocks = MODE_BLOCK_SITES * mode_blocks + SINGLE_BLOCK_SITES * len(model.single_transformer_blocks)
    return blocks + 1 + proofs


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


def reference_image() -> Any:
    """A random 48 x 40 RGB image: padded to its 64 x 64 canvas (4 x 4 tokens) by the pipelines'
    preprocess step."""
    from PIL import Image

    pixels = torch.randint(0, 256, (40, 48, 3), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def run_pipeline(pipe: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
    """A FLUX.3 modular pipeline call of PIPELINE_STEPS steps from a fixed seed on diffusers' native
    attention backend: its latents and images (output_type "pt")."""
    from diffusers.models.attention_dispatch import attention_backend

    settings = {"num_inference_steps": PIPELINE_STEPS, "output_type": "pt", **kwargs}
    with torch.inference_mode(), attention_backend("native"):
        return pipe(generator=torch.Generator().manual_seed(0), output=["latents", "images"], **settings)
