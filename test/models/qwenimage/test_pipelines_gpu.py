"""Qwen-Image's pipeline on CUDA: `enable(pipe)` gives QwenImagePipeline's own images bit for bit with
the kernels running in every block of every transformer call (its norms, GELUs and, at head_dim 128,
its attention prologue), bf16, true CFG with a padded prompt."""

from __future__ import annotations

import pytest
import torch

from ...conftest import images_alone_and_enabled
from . import support
from .test_pipelines import _prompts

pytestmark = pytest.mark.gpu
pytest.importorskip("diffusers.pipelines.qwenimage")
STEPS = 2


def test_text_to_image_with_true_cfg() -> None:
    model = support.transformer(attention_head_dim=128, num_attention_heads=3, axes_dims_rope=(16, 56, 56))
    pipe = support.pipeline(model).to("cuda", torch.bfloat16)
    prompts = {
        k: v.to("cuda", torch.bfloat16 if v.is_floating_point() else v.dtype) for k, v in _prompts().items()
    }

    def run() -> torch.Tensor:
        generator = torch.Generator().manual_seed(1)
        return pipe(
            **prompts,
            true_cfg_scale=2.0,
            num_inference_steps=STEPS,
            height=64,
            width=64,
            generator=generator,
            output_type="pt",
        ).images

    launches = images_alone_and_enabled(pipe, run)
    # a prompt's and a negative prompt's call a step: 7 launches a block, the output norm
    assert launches == STEPS * 2 * (7 * support.TINY["num_layers"] + 1)
