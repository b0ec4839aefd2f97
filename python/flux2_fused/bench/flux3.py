"""The FLUX.3 family in the benchmarks: diffusers' Flux3Transformer2DModel with random weights (its
q/k norms in fp32, as `from_pretrained` keeps them), one step's inputs, and diffusers' FLUX.3 modular
pipeline of random components around it.

FLUX.3 has no model of the package's own, so its benchmarks run on the diffusers host only; the
setups (LoRA, offload, quantization) are `bench.hosts`' own, applied to this transformer.
"""

from __future__ import annotations

import inspect
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


# AutoencoderKLFlux2's arguments for the VAE of the small test sizes: the real VAE's four levels (8x
# downsampling, so 16-pixel tokens as `Flux3ImageProcessor` assumes) at 16 channels each, one layer a
# block; its latent channels follow the transformer (`vae_config`).
SMALL_VAE = {"block_out_channels": (16,) * 4, "norm_num_groups": 8, "layers_per_block": 1}
# The pipeline steps that need the text encoder: the prompt upsampler (a Qwen3.5 model, whose own
# docstring says to pop it to encode a prompt as given) and the Qwen3-VL text encoder, which runs
# unconditionally. Without them `prompt_embeds` (and `negative_prompt_embeds`) are pipeline inputs.
TEXT_STEPS = ("prompt_upsampler", "text_encoder")


def vae_config(transformer: nn.Module) -> dict[str, Any]:
    """AutoencoderKLFlux2's arguments for a FLUX.3 transformer: its default config (FLUX.3 [klein]'s
    VAE: 32 latent channels, packed 2x2 into the transformer's 128 input channels) for a transformer
    of that width, else SMALL_VAE with a quarter of the transformer's input channels."""
    from diffusers import AutoencoderKLFlux2

    latent_channels = transformer.config.in_channels // 4
    default = inspect.signature(AutoencoderKLFlux2).parameters["latent_channels"].default
    return {} if latent_channels == default else {**SMALL_VAE, "latent_channels": latent_channels}


def pipeline(transformer: nn.Module, seed: int = 0, guidance_scale: float | None = None) -> Any:
    """diffusers' FLUX.3 modular pipeline around `transformer`: `Flux3DistilledModularPipeline` for
    a flow-map transformer (one pass a step, no guider), else `Flux3ModularPipeline` (classifier-free
    guidance through its guider, at `guidance_scale` where given, else the blocks' default). Its auto
    blocks without the TEXT_STEPS, so callers pass prompt embeddings; a random VAE (`vae_config`) on
    the transformer's device and dtype; the scheduler (FLUX.3's shift) and the image processor the
    blocks' own defaults. The progress bars are off."""
    from diffusers import AutoencoderKLFlux2, ClassifierFreeGuidance
    from diffusers.modular_pipelines import flux3 as modular

    if transformer.config.flow_map:
        blocks, cls = modular.Flux3DistilledAutoBlocks(), modular.Flux3DistilledModularPipeline
    else:
        blocks, cls = modular.Flux3AutoBlocks(), modular.Flux3ModularPipeline
    for name in TEXT_STEPS:
        blocks.sub_blocks.pop(name)
    _without_progress_bars(blocks)
    pipe = cls(blocks=blocks)
    vae = hosts.random_vae(AutoencoderKLFlux2, transformer, seed, **vae_config(transformer))
    pipe.update_components(transformer=transformer, vae=vae)
    if guidance_scale is not None and not transformer.config.flow_map:
        pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=guidance_scale))
    return pipe


def _without_progress_bars(block: Any) -> None:
    """Turn off the progress bars of a modular pipeline block and of every block under it (they would
    interleave with the reports): the pipeline's own `set_progress_bar_config` reaches only its
    top-level steps, and the denoise loop, the block with a bar, is nested under the auto steps."""
    if hasattr(block, "set_progress_bar_config"):
        block.set_progress_bar_config(disable=True)
    for sub_block in getattr(block, "sub_blocks", {}).values():
        _without_progress_bars(sub_block)
