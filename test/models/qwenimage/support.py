"""A tiny Qwen-Image for the tests: diffusers' QwenImageTransformer2DModel at a small size with its
default init, and one step's inputs (packed latents, text features with a padding mask)."""

from __future__ import annotations

from typing import Any

import torch

from flux2_fused.models.qwenimage import blocks

# Two blocks, D = 2 heads x 16, RoPE axes summing to the head size, 16 packed input channels.
TINY = {
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 24,
    "axes_dims_rope": (4, 6, 6),
}
FAMILY = blocks  # for count_block_code


def transformer(seed: int = 1, **overrides: Any) -> torch.nn.Module:
    """The tiny transformer with diffusers' default init from `seed`, in eval mode."""
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    return QwenImageTransformer2DModel(**{**TINY, **overrides}).eval()


def step_inputs(
    batch: int = 2,
    height: int = 3,
    width: int = 5,
    txt_tokens: int = 7,
    dtype: torch.dtype = torch.float32,
    seed: int = 3,
    padded: int = 2,
) -> dict[str, Any]:
    """A step's arguments: a height x width grid of packed latents, text features whose last
    `padded` tokens of the first batch element are padding (0 in the mask), the timestep."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    mask = torch.ones(batch, txt_tokens, dtype=torch.long)
    if padded:
        mask[0, txt_tokens - padded :] = 0
    return {
        "hidden_states": randn(batch, height * width, TINY["in_channels"]),
        "encoder_hidden_states": randn(batch, txt_tokens, TINY["joint_attention_dim"]),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.full((batch,), 0.7),
        "img_shapes": [(1, height, width)] * batch,
    }


def pipeline(transformer: torch.nn.Module, cls: type | None = None, **components: Any) -> Any:
    """A Qwen-Image pipeline (`cls`, default QwenImagePipeline) around `transformer`: a two-level
    AutoencoderKLQwenImage of 4 latent channels (the tiny transformer's 16 inputs are 2x2 packed
    latents), diffusers' default scheduler, no text encoder (callers pass prompt embeddings and
    masks), the pipeline's other `components` (a ControlNet, the edit pipelines' processor); the
    progress bar off."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(
        base_dim=16,
        z_dim=4,
        dim_mult=[1, 2],
        num_res_blocks=1,
        temperal_downsample=[False],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    ).eval()
    pipe = (cls or QwenImagePipeline)(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
        **components,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
