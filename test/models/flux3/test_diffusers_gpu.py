"""FLUX.3 on the GPU: `enable()` on diffusers' Flux3Transformer2DModel gives diffusers' output bit for
bit with every site fused (the per-token modulated norms, the two-term pending updates, the twin
norms into the joint buffer, the fp32 QK prologue, SwiGLU, the per-token output norm), at a small
size where every op runs (also with torchao's float8 linears) and at the full FLUX.3 [klein] size at
1024x1024."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flux2_fused.bench import flux3
from flux2_fused.integrations.diffusers import enable

from ...conftest import SITE_KERNELS, fused_launches
from .support import fused_sites

pytestmark = pytest.mark.gpu
pytest.importorskip("diffusers.models.transformers.transformer_flux3")


def _compare(model: torch.nn.Module, inputs: dict[str, Any], references: bool) -> None:
    with torch.inference_mode():
        expected = model(**inputs, return_dict=False)[0]
        handle = enable(model)
        patched = model(**inputs, return_dict=False)[0]
        launches = fused_launches(lambda: model(**inputs, return_dict=False), SITE_KERNELS)
        handle.disable()
    assert torch.equal(patched.view(torch.int16), expected.view(torch.int16))
    assert launches == fused_sites(model, references)


@pytest.fixture(autouse=True)
def free_gpu_memory():
    yield
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("references", [False, True], ids=["t2i", "reference"])
def test_small_is_diffusers_bit_for_bit_and_fused(dtype: torch.dtype, batch: int, references: bool) -> None:
    device = torch.device("cuda")
    model = flux3.random_transformer("flux3-small", device, dtype)
    inputs = flux3.step_inputs(
        "flux3-small", batch, 37 * 11, 77, dtype, width_tokens=37, reference_tokens=203 if references else 0
    )
    _compare(model, inputs, references)


def test_flow_map_small() -> None:
    device = torch.device("cuda")
    model = flux3.random_transformer("flux3-small", device, torch.bfloat16, flow_map=True)
    inputs = flux3.step_inputs("flux3-small", 1, 256, 64, torch.bfloat16)
    inputs["target_timestep"] = torch.full((1,), 0.25, device="cuda", dtype=torch.bfloat16)
    _compare(model, inputs, False)


@pytest.mark.parametrize("granularity", ["PerRow", "PerTensor"])
def test_torchao_float8_small_is_the_quantized_models_bit_for_bit_and_fused(granularity: str) -> None:
    """torchao's dynamic float8 quantization (activations and weights scaled per row or per tensor) of
    every Linear: the block code's quantized linears take their inputs from `float8_quant` or, per
    row, from the norm's own kernel (every mode block's norm and every joint block's twin norms),
    every elementwise site around them fuses, and the output is the quantized model's own; with a
    reference image, so all three modes run."""
    quantization = pytest.importorskip("torchao.quantization")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs sm_89 or newer")
    # 24 heads: klein's width (3072), which the norms' quantizing form takes
    model = flux3.random_transformer(
        "flux3-small", torch.device("cuda"), torch.bfloat16, num_attention_heads=24
    )
    config = quantization.Float8DynamicActivationFloat8WeightConfig(
        granularity=getattr(quantization, granularity)()
    )
    quantization.quantize_(model, config)
    assert type(model.single_transformer_blocks[0].attn.to_q.weight) is not torch.nn.Parameter
    inputs = flux3.step_inputs("flux3-small", 2, 16 * 16, 64, torch.bfloat16, reference_tokens=128)
    _compare(model, inputs, True)
    handle = enable(model)
    with torch.inference_mode():
        norms = fused_launches(
            lambda: model(**inputs, return_dict=False), ("gated_resnorm_kernel_quantized",)
        )
    handle.disable()
    sites = 3 * len(model.txt_mode_blocks) + len(model.single_transformer_blocks)
    assert norms == (sites if granularity == "PerRow" else 0)


def test_klein_at_1024() -> None:
    """The full FLUX.3 [klein] transformer (random weights), one bf16 step at 1024x1024."""
    device = torch.device("cuda")
    model = flux3.random_transformer("flux3-klein", device, torch.bfloat16)
    inputs = flux3.step_inputs("flux3-klein", 1, 64 * 64, 512, torch.bfloat16)
    _compare(model, inputs, False)
