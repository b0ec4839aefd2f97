"""A tiny Z-Image for the tests: diffusers' ZImageTransformer2DModel at a small size with its default
init, and one step's inputs (per-sample latents and caption features, the captions of unequal length so
the unified rows of a batch are padded and masked)."""

from __future__ import annotations

from typing import Any

import torch

from flux2_fused.models.zimage import blocks

# Two main layers and one refiner of each kind, D = 2 heads x 16, RoPE axes summing to the head size.
TINY = {
    "in_channels": 4,
    "dim": 32,
    "n_layers": 2,
    "n_refiner_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 2,
    "cap_feat_dim": 24,
    "axes_dims": [4, 6, 6],
    "axes_lens": [64, 32, 32],
}
FAMILY = blocks  # for count_block_code
BLOCKS = TINY["n_layers"] + 2 * TINY["n_refiner_layers"]  # the main layers and both refiners


def transformer(seed: int = 1, **overrides: Any) -> torch.nn.Module:
    """The tiny transformer with diffusers' default init from `seed` (its zero-initialized
    modulations and final layer drawn at random, so every path changes the output), in eval mode."""
    from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel

    torch.manual_seed(seed)
    model = ZImageTransformer2DModel(**{**TINY, **overrides}).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adaLN_modulation" in name or "final_layer" in name:
                p.normal_(0, 0.2)
    return model


def step_inputs(
    batch: int = 2,
    height: int = 6,
    width: int = 10,
    caption: tuple[int, ...] = (9, 5),
    dtype: torch.dtype = torch.float32,
    seed: int = 3,
) -> dict[str, Any]:
    """A step's arguments as `ZImagePipeline` passes them: one latent [C, 1, H, W] and one caption's
    features [L, cap_feat_dim] a sample (lengths from `caption`, cycled), the timestep."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    return {
        "x": [randn(TINY["in_channels"], 1, height, width) for _ in range(batch)],
        "t": torch.full((batch,), 0.7),
        "cap_feats": [randn(caption[i % len(caption)], TINY["cap_feat_dim"]) for i in range(batch)],
    }


def sample(out: Any) -> torch.Tensor:
    """The model's output (a list of per-sample latents) stacked."""
    return torch.stack(list(out.sample if hasattr(out, "sample") else out[0]))


def pipeline(cls_name: str, model: torch.nn.Module | None = None, **components: Any) -> Any:
    """A Z-Image pipeline around the tiny transformer: a two-level AutoencoderKL of the transformer's 4
    latent channels, diffusers' default scheduler, no text encoder (callers pass embeddings), and
    `components` (a ControlNet); `model` as the transformer instead of the tiny one where given."""
    import diffusers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler

    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=(16, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=TINY["in_channels"],
        norm_num_groups=8,
        layers_per_block=1,
        shift_factor=0.1,
        scaling_factor=0.5,
    ).eval()
    pipe = getattr(diffusers, cls_name)(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        transformer=model if model is not None else transformer(),
        **components,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def embeds(seed: int, lengths: tuple[int, ...]) -> list[torch.Tensor]:
    """Caption embeddings of these lengths, as the pipelines take `prompt_embeds`."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, TINY["cap_feat_dim"], generator=gen) for n in lengths]
