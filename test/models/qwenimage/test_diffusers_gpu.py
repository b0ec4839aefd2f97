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


def _one_block_at_qwen_images_width(dtype: torch.dtype) -> tuple[torch.nn.Module, dict]:
    """One block of Qwen-Image's width on 64x64 packed latents (4096 tokens) and 512 text tokens,
    64 of them padding."""
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
    return model, inputs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_one_block_at_qwen_images_width(dtype: torch.dtype) -> None:
    """The block's prologue launches too."""
    _check(*_one_block_at_qwen_images_width(dtype), 1, prologues=True)


def test_torchao_float8_per_row_norms_quantize_for_the_linears() -> None:
    """torchao's per-row float8 on the block's Linears: the four modulated norms hand their Linears
    their quantization from the norm's own kernel, and the output is the quantized model's."""
    quantization = pytest.importorskip("torchao.quantization")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs sm_89 or newer")
    model, inputs = _one_block_at_qwen_images_width(torch.bfloat16)
    config = quantization.Float8DynamicActivationFloat8WeightConfig(granularity=quantization.PerRow())
    quantization.quantize_(model.transformer_blocks, config)
    with torch.inference_mode():
        expected = model(**inputs).sample
        handle = enable(model)
        patched = model(**inputs).sample
        norms = fused_launches(lambda: model(**inputs), ("gated_resnorm_kernel_quantized",))
        handle.disable()
    assert bits_equal(patched, expected)
    assert norms == 4
