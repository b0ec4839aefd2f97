"""Z-Image's diffusers pipelines with `enable(pipe)` (tiny components, CPU): text-to-image with
classifier-free guidance and image-to-image give the pipeline's own images bit for bit, every block of
every step through the family's block code, its fused sites taken (the kernels' references standing in
for them)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flux2_fused.integrations.diffusers import enable
from flux2_fused.ops import bits_equal

from . import support

pytest.importorskip("diffusers.pipelines.z_image")
STEPS = 2


def _pipeline(cls_name: str) -> Any:
    """A Z-Image pipeline around the tiny transformer: a two-level AutoencoderKL of the transformer's 4
    latent channels, diffusers' default scheduler, no text encoder (callers pass embeddings)."""
    import diffusers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler

    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=(16, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=support.TINY["in_channels"],
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
        transformer=support.transformer(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _embeds(seed: int, lengths: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, support.TINY["cap_feat_dim"], generator=gen) for n in lengths]


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


def test_text_to_image_with_guidance(prologue_on_cpu: list) -> None:
    pipe = _pipeline("ZImagePipeline")
    ran = _compare(
        pipe,
        prompt_embeds=_embeds(1, (9,)),
        negative_prompt_embeds=_embeds(2, (5,)),
        guidance_scale=4.0,
        height=24,
        width=40,
        num_inference_steps=STEPS,
    )
    assert all(ran) and len(ran) == STEPS * support.BLOCKS  # the CFG batch runs as one call a step
    assert len(prologue_on_cpu) == len(ran)


def test_image_to_image(prologue_on_cpu: list) -> None:
    pipe = _pipeline("ZImageImg2ImgPipeline")
    image = torch.rand(1, 3, 24, 40, generator=torch.Generator().manual_seed(7))
    ran = _compare(
        pipe,
        image=image,
        strength=0.75,
        prompt_embeds=_embeds(1, (9,)),
        negative_prompt_embeds=_embeds(2, (9,)),
        guidance_scale=3.0,
        height=24,
        width=40,
        num_inference_steps=4,
    )
    assert ran and all(ran)
