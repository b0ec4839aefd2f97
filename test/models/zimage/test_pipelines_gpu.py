"""Z-Image's pipelines on CUDA: `enable(pipe)` gives the pipeline's own images bit for bit with the
kernels running in every block of every step (the prologue, three sandwich-norm sites and the
feed-forward's SwiGLU), bf16, at a width where each kernel takes its site (3 heads x 128, a
1024-wide feed-forward)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ...conftest import images_alone_and_enabled
from . import support

pytestmark = pytest.mark.gpu
pytest.importorskip("diffusers.pipelines.z_image")
STEPS = 2
LAUNCHES_A_BLOCK = 5  # the prologue, three sandwich sites, the SwiGLU


def _pipeline(cls_name: str) -> Any:
    model = support.transformer(dim=384, n_heads=3, n_kv_heads=3, axes_dims=[32, 48, 48])
    return support.pipeline(cls_name, model).to("cuda", torch.bfloat16)


def _cuda(embeds: list[torch.Tensor]) -> list[torch.Tensor]:
    return [e.to("cuda", torch.bfloat16) for e in embeds]


def _images_both_ways(pipe: Any, **kwargs: Any) -> int:
    return images_alone_and_enabled(
        pipe, lambda: pipe(**kwargs, generator=torch.Generator().manual_seed(5), output_type="pt").images
    )


def test_text_to_image_with_guidance() -> None:
    launches = _images_both_ways(
        _pipeline("ZImagePipeline"),
        prompt_embeds=_cuda(support.embeds(1, (9,))),
        negative_prompt_embeds=_cuda(support.embeds(2, (5,))),
        guidance_scale=4.0,
        height=64,
        width=64,
        num_inference_steps=STEPS,
    )
    assert launches == STEPS * support.BLOCKS * LAUNCHES_A_BLOCK  # the CFG batch: one call a step


def test_inpainting() -> None:
    mask = torch.zeros(1, 1, 64, 64)
    mask[..., 16:, 32:] = 1.0
    launches = _images_both_ways(
        _pipeline("ZImageInpaintPipeline"),
        image=torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(7)),
        mask_image=mask,
        strength=0.8,
        prompt_embeds=_cuda(support.embeds(1, (9,))),
        negative_prompt_embeds=_cuda(support.embeds(2, (6,))),
        guidance_scale=3.0,
        height=64,
        width=64,
        num_inference_steps=4,
    )
    assert launches > 0 and launches % (support.BLOCKS * LAUNCHES_A_BLOCK) == 0
