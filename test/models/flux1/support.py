"""Tiny FLUX.1 components for the tests: diffusers' FluxTransformer2DModel at the `flux1-tiny` size, a
two-level AutoencoderKL, the pipelines around them with prompt embeddings given (no text encoders),
and one step's inputs."""

from __future__ import annotations

from typing import Any

import torch

from flux2_fused.models.flux1 import blocks, flux1_config, image_ids, text_ids

TINY = flux1_config("flux1-tiny")
BLOCKS = TINY["num_layers"] + TINY["num_single_layers"]
FAMILY = blocks  # for count_block_code


def transformer(seed: int = 1, **overrides: Any) -> torch.nn.Module:
    """The tiny FLUX.1 transformer with diffusers' default init from `seed`, in eval mode."""
    from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(**{**TINY, **overrides}).eval()


def step_inputs(
    batch: int = 2,
    img_tokens: int = 9,
    txt_tokens: int = 5,
    dtype: torch.dtype = torch.float32,
    seed: int = 3,
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    return {
        "hidden_states": randn(batch, img_tokens, TINY["in_channels"]),
        "encoder_hidden_states": randn(batch, txt_tokens, TINY["joint_attention_dim"]),
        "pooled_projections": randn(batch, TINY["pooled_projection_dim"]),
        "timestep": torch.full((batch,), 0.7),
        "img_ids": image_ids(img_tokens),
        "txt_ids": text_ids(txt_tokens),
        "guidance": torch.full((batch,), 3.5),
    }


def vae() -> torch.nn.Module:
    """A two-level AutoencoderKL with FLUX.1's shift and scale and 4 latent channels (the tiny
    transformer's 16 input channels are 2x2 packed latents)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(
        block_out_channels=(32, 32),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=8,
        layers_per_block=1,
        shift_factor=0.1159,
        scaling_factor=0.3611,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def pipeline(cls: type, model: torch.nn.Module | None = None, **components: Any) -> Any:
    """A FLUX.1 pipeline class around the tiny transformer (or `model`), without text encoders."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = cls(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae(),
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=model if model is not None else transformer(),
        **components,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe: Any, **kwargs: Any) -> torch.Tensor:
    """A pipeline call at 32 px, two steps, fixed prompt embeddings and seed; the image tensor."""
    from diffusers.models.attention_dispatch import attention_backend

    gen = torch.Generator().manual_seed(3)
    embeds = torch.randn(1, 6, TINY["joint_attention_dim"], generator=gen)
    pooled = torch.randn(1, TINY["pooled_projection_dim"], generator=gen)
    settings = {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 3.5, **kwargs}
    with torch.inference_mode(), attention_backend("native"):
        return pipe(
            prompt_embeds=embeds,
            pooled_prompt_embeds=pooled,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
            **settings,
        ).images


def image(side: int = 32, seed: int = 5) -> Any:
    """A random RGB PIL image."""
    from PIL import Image

    pixels = torch.randint(
        0, 256, (side, side, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8
    )
    return Image.fromarray(pixels.numpy())


def controlnet() -> torch.nn.Module:
    """A FluxControlNetModel of the tiny size with one block of each kind."""
    from diffusers import FluxControlNetModel

    torch.manual_seed(2)
    return FluxControlNetModel(**{**TINY, "num_layers": 1, "num_single_layers": 1}).eval()
