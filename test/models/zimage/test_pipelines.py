"""Z-Image's diffusers pipelines with `enable(pipe)` (tiny components, CPU): text-to-image with
classifier-free guidance, image-to-image, inpainting, ControlNet and ControlNet inpainting give the
pipeline's own images bit for bit, every block of every step through the family's block code, its
fused sites taken (the kernels' references standing in for them)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flux2_fused.integrations.diffusers import enable
from flux2_fused.ops import bits_equal

from . import support

pytest.importorskip("diffusers.pipelines.z_image")
STEPS = 2


def _compare(pipe: Any, **kwargs: Any) -> list[int]:
    """The pipeline's images alone and with enable(), equal bit for bit; the block calls the block code
    computed in the enabled run."""
    from flux2_fused.models.zimage import blocks

    def run() -> torch.Tensor:
        return pipe(**kwargs, generator=torch.Generator().manual_seed(5), output_type="pt").images

    expected = run()
    handle = enable(pipe)
    ran: list[int] = []
    for cls in list(handle.host.block_forwards):

        def counting(*args: Any, **kw: Any) -> Any:
            out = blocks.block_call(*args, **kw)
            ran.append(out is not None)
            return out

        handle.host.block_forwards[cls] = counting
    try:
        got = run()
    finally:
        handle.disable()
    assert bits_equal(got, expected)
    return ran


def _prompts(negative: int = 5, guidance: float = 4.0) -> dict[str, Any]:
    """A 9-token prompt and a `negative`-token negative prompt at `guidance`, a 24x40 image."""
    return {
        "prompt_embeds": support.embeds(1, (9,)),
        "negative_prompt_embeds": support.embeds(2, (negative,)),
        "guidance_scale": guidance,
        "height": 24,
        "width": 40,
    }


def _image(seed: int) -> torch.Tensor:
    return torch.rand(1, 3, 24, 40, generator=torch.Generator().manual_seed(seed))


def _mask() -> torch.Tensor:
    mask = torch.zeros(1, 1, 24, 40)
    mask[..., 8:, 16:] = 1.0
    return mask


def test_text_to_image_with_guidance(prologue_on_cpu: list) -> None:
    pipe = support.pipeline("ZImagePipeline")
    ran = _compare(
        pipe,
        num_inference_steps=STEPS,
        **_prompts(),
    )
    assert all(ran) and len(ran) == STEPS * support.BLOCKS  # the CFG batch runs as one call a step
    assert len(prologue_on_cpu) == len(ran)


def test_image_to_image(prologue_on_cpu: list) -> None:
    pipe = support.pipeline("ZImageImg2ImgPipeline")
    ran = _compare(
        pipe, image=_image(7), strength=0.75, num_inference_steps=4, **_prompts(negative=9, guidance=3.0)
    )
    assert ran and all(ran)


def test_inpainting(prologue_on_cpu: list) -> None:
    pipe = support.pipeline("ZImageInpaintPipeline")
    ran = _compare(
        pipe,
        image=_image(7),
        mask_image=_mask(),
        strength=0.8,
        num_inference_steps=4,
        **_prompts(negative=6, guidance=3.0),
    )
    assert ran and all(ran) and len(prologue_on_cpu) == len(ran)


def _controlnet(control_in_dim: int) -> Any:
    """A tiny ZImageControlNetModel at the transformer's sizes, control blocks at layer 0 (its
    refiners and embedders become the transformer's when the pipeline is built)."""
    from diffusers import ZImageControlNetModel

    torch.manual_seed(3)
    sizes = {key: support.TINY[key] for key in ("dim", "n_refiner_layers", "n_heads", "n_kv_heads")}
    return ZImageControlNetModel(control_layers_places=[0], control_in_dim=control_in_dim, **sizes).eval()


@pytest.mark.parametrize("control_in_dim", [support.TINY["in_channels"], 2 * support.TINY["in_channels"]])
def test_controlnet(control_in_dim: int, prologue_on_cpu: list) -> None:
    """ZImageControlNetPipeline: the ControlNet runs as diffusers' own (calling the transformer's
    refiner blocks, which run on the block code) and its residuals join the main layers as diffusers'
    forward adds them; wider control inputs (the 2.0 models) zero-padded by the pipeline."""
    pipe = support.pipeline("ZImageControlNetPipeline", controlnet=_controlnet(control_in_dim))
    ran = _compare(
        pipe,
        control_image=_image(4),
        controlnet_conditioning_scale=0.7,
        num_inference_steps=STEPS,
        **_prompts(),
    )
    refiners = 2 * support.TINY["n_refiner_layers"]  # the ControlNet's calls of the shared refiners
    assert all(ran) and len(ran) == STEPS * (support.BLOCKS + refiners)


def test_controlnet_inpainting(prologue_on_cpu: list) -> None:
    """ZImageControlNetInpaintPipeline: the control image's latents with the mask and the masked
    image's latents (2C + 1 channels) as the ControlNet's input."""
    pipe = support.pipeline(
        "ZImageControlNetInpaintPipeline", controlnet=_controlnet(2 * support.TINY["in_channels"] + 1)
    )
    ran = _compare(
        pipe,
        image=_image(7),
        mask_image=_mask(),
        control_image=_image(4),
        controlnet_conditioning_scale=0.7,
        num_inference_steps=STEPS,
        **_prompts(),
    )
    assert ran and all(ran)


def test_cache_dit_in_either_order(prologue_on_cpu: list) -> None:
    """cache-dit's DBCache on the pipeline, before or after enable(): the pipeline's images are the
    cache's alone, the blocks the cache runs run the block code, and it skips some (fewer than every
    block of every step). (diffusers' own caches do not take Z-Image: its transformer has no
    `enable_cache` and its pipelines set no cache context, and its blocks' arguments are not those
    FirstBlockCache reads.)"""
    cache_dit = pytest.importorskip("cache_dit")
    images = {}
    for order in ("alone", "enable-then-cache", "cache-then-enable"):
        pipe = support.pipeline("ZImagePipeline", support.transformer(n_layers=4))
        handle = enable(pipe) if order == "enable-then-cache" else None
        config = cache_dit.DBCacheConfig(
            Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=10.0, max_warmup_steps=1
        )
        cache_dit.enable_cache(pipe, cache_config=config)
        handle = enable(pipe) if order == "cache-then-enable" else handle
        prologue_on_cpu.clear()
        with torch.inference_mode():
            images[order] = pipe(
                prompt_embeds=support.embeds(1, (9,)),
                num_inference_steps=6,
                guidance_scale=0.0,
                height=24,
                width=40,
                generator=torch.Generator().manual_seed(1),
                output_type="pt",
            ).images
        assert (len(prologue_on_cpu) > 0) == (handle is not None)
        assert len(prologue_on_cpu) < 6 * (4 + 2 * support.TINY["n_refiner_layers"])
    assert all(torch.equal(image, images["alone"]) for image in images.values())
