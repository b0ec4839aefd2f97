"""Qwen-Image's pipelines with `enable(pipe)` (tiny components, CPU): text to image with true CFG and a
padded prompt, image to image, inpainting, ControlNet and the edit pipelines (one condition image, and
two of different shapes) give diffusers' images bit for bit with every transformer call's blocks
through the block code."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flux2_fused.integrations.diffusers import enable

from ...conftest import count_block_code
from . import support

diffusers = pytest.importorskip("diffusers")


def _prompts() -> dict[str, torch.Tensor]:
    """Prompt and negative-prompt embeddings, the prompt's last two tokens padding."""
    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, 7, support.TINY["joint_attention_dim"], generator=gen)
    mask = torch.ones(1, 7, dtype=torch.long)
    mask[0, 5:] = 0
    return {
        "prompt_embeds": embeds,
        "prompt_embeds_mask": mask,
        "negative_prompt_embeds": embeds * 0.5,
        "negative_prompt_embeds_mask": torch.ones(1, 7, dtype=torch.long),
    }


def _images_both_ways(pipe: Any, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> int:
    """The pipeline's images alone and with enable(pipe) are equal; returns the block bodies run."""

    def run() -> torch.Tensor:
        generator = torch.Generator().manual_seed(1)
        return pipe(
            **_prompts(), num_inference_steps=2, generator=generator, output_type="pt", **kwargs
        ).images

    bodies = count_block_code(monkeypatch, "double_block_body", support.FAMILY)
    with torch.inference_mode():
        expected = run()
        handle = enable(pipe)
        try:
            patched = run()
        finally:
            handle.disable()
    assert torch.equal(patched, expected)
    return len(bodies)


def test_text_to_image_with_true_cfg(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = support.pipeline(support.transformer())
    runs = _images_both_ways(pipe, monkeypatch, true_cfg_scale=2.0, height=32, width=32)
    assert runs == 2 * 2 * support.TINY["num_layers"]  # two steps, prompt and negative prompt


def test_image_to_image(monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusers import QwenImageImg2ImgPipeline

    pipe = support.pipeline(support.transformer(), QwenImageImg2ImgPipeline)
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    runs = _images_both_ways(pipe, monkeypatch, image=image, strength=0.9, height=32, width=32)
    assert runs > 0


def test_inpainting(monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusers import QwenImageInpaintPipeline

    pipe = support.pipeline(support.transformer(), QwenImageInpaintPipeline)
    gen = torch.Generator().manual_seed(2)
    image = torch.rand(1, 3, 32, 32, generator=gen)
    mask = torch.zeros(1, 1, 32, 32)
    mask[..., 8:24, 8:24] = 1.0
    runs = _images_both_ways(
        pipe, monkeypatch, image=image, mask_image=mask, strength=0.9, height=32, width=32
    )
    assert runs > 0


def test_controlnet(monkeypatch: pytest.MonkeyPatch) -> None:
    """QwenImageControlNetPipeline: the ControlNet's residuals reach every transformer block as
    diffusers adds them (the ControlNet model itself runs as diffusers' own)."""
    from diffusers import QwenImageControlNetModel, QwenImageControlNetPipeline

    torch.manual_seed(0)
    controlnet = QwenImageControlNetModel(**{**support.TINY, "num_layers": 1}).eval()
    pipe = support.pipeline(support.transformer(), QwenImageControlNetPipeline, controlnet=controlnet)
    control = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    runs = _images_both_ways(
        pipe, monkeypatch, control_image=control, controlnet_conditioning_scale=0.8, height=32, width=32
    )
    assert runs == 2 * 2 * support.TINY["num_layers"]


def test_edit_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    """QwenImageEditPipeline (a model without zero-timestep conditioning): the condition image's
    latents join the image rows, and every block runs the block code. The pipeline sizes its condition
    image to a 1024x1024 area; here that area is 32x32 in both runs (its `calculate_dimensions` made
    small), so the CPU's VAE stays quick."""
    from diffusers import QwenImageEditPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit
    from PIL import Image

    original = edit.calculate_dimensions
    monkeypatch.setattr(edit, "calculate_dimensions", lambda area, ratio: original(32 * 32, ratio))
    pipe = support.pipeline(support.transformer(), QwenImageEditPipeline, processor=None)
    pixels = (torch.rand(32, 32, 3, generator=torch.Generator().manual_seed(3)) * 255).to(torch.uint8)
    image = Image.fromarray(pixels.numpy())
    runs = _images_both_ways(pipe, monkeypatch, image=image, true_cfg_scale=2.0, height=32, width=32)
    assert runs == 2 * 2 * support.TINY["num_layers"]


def test_edit_plus_pipeline_with_two_images(monkeypatch: pytest.MonkeyPatch) -> None:
    """QwenImageEditPlusPipeline: two condition images of different shapes, each its own latent
    segment after the generated image's rows (their RoPE positions per segment), every block through
    the block code. Its condition and VAE areas are 32x32 here (`calculate_dimensions` made small)."""
    from diffusers import QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus
    from PIL import Image

    original = edit_plus.calculate_dimensions
    monkeypatch.setattr(edit_plus, "calculate_dimensions", lambda area, ratio: original(32 * 32, ratio))
    pipe = support.pipeline(support.transformer(), QwenImageEditPlusPipeline, processor=None)
    gen = torch.Generator().manual_seed(3)
    images = [
        Image.fromarray((torch.rand(h, w, 3, generator=gen) * 255).to(torch.uint8).numpy())
        for h, w in ((32, 32), (32, 48))
    ]
    runs = _images_both_ways(pipe, monkeypatch, image=images, true_cfg_scale=2.0, height=32, width=32)
    assert runs == 2 * 2 * support.TINY["num_layers"]
