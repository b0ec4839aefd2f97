"""Qwen-Image on CUDA: `enable()` on diffusers' QwenImageTransformer2DModel equals diffusers bit for bit
with the kernels running (each modulated norm one launch, each GELU one, the output norm, and at
head_dim 128 each block's attention prologue), bf16 and fp16, with and without text padding, at the
tiny size and at one block of Qwen-Image's width (24 heads x 128) over 1024x1024's 4096 image
tokens."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.integrations.diffusers import enable
from flux2_fused.ops import bits_equal

from ...conftest import fused_launches
from . import support

pytestmark = pytest.mark.gpu
pytest.importorskip("diffusers.models.transformers.transformer_qwenimage")


def _check(model: torch.nn.Module, inputs: dict, blocks: int, prologues: bool = False) -> None:
    with torch.inference_mode():
        expected = model(**inputs).sample
        handle = enable(model)
        patched = model(**inputs).sample
        launches = fused_launches(lambda: model(**inputs))
        handle.disable()
    assert bits_equal(patched, expected)
    # four norms and two GELUs a block (and its prologue where head_dim is 128), the output norm
    assert launches == (7 if prologues else 6) * blocks + 1


@pytest.mark.parametrize("padded", [0, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tiny_on_cuda(dtype: torch.dtype, padded: int) -> None:
    model = support.transformer().to("cuda", dtype)
    inputs = support.step_inputs(dtype=dtype, padded=padded)
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    _check(model, inputs, support.TINY["num_layers"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_one_block_at_qwen_images_width(dtype: torch.dtype) -> None:
    """One block of Qwen-Image's width on 64x64 packed latents (4096 tokens) and 512 text tokens,
    64 of them padding: the prologue launches too."""
    model = support.transformer(
        num_layers=1,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=3584,
        in_channels=64,
        out_channels=16,
        axes_dims_rope=(16, 56, 56),
    ).to("cuda", dtype)
    gen = torch.Generator("cuda").manual_seed(0)
    mask = torch.ones(1, 512, dtype=torch.long, device="cuda")
    mask[0, 448:] = 0
    inputs = {
        "hidden_states": torch.randn(1, 4096, 64, generator=gen, device="cuda").to(dtype),
        "encoder_hidden_states": torch.randn(1, 512, 3584, generator=gen, device="cuda").to(dtype),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.full((1,), 0.5, device="cuda"),
        "img_shapes": [(1, 64, 64)],
    }
    _check(model, inputs, 1, prologues=True)
