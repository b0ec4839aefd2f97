"""Z-Image on CUDA: `enable()` on diffusers' ZImageTransformer2DModel equals diffusers bit for bit with
the kernels running (a block's prologue, its three sandwich-norm sites and its SwiGLU at
Z-Image-Turbo's width), bf16 and fp16, at the tiny size (head_dim 16, D = 32: no launch) and at
Z-Image-Turbo's width (30 heads x 128, one main layer and one refiner of each kind) over 1024x1024's
4096 image tokens and a caption padded to 512 rows."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.integrations.diffusers import enable
from flux2_fused.ops import bits_equal

from ...conftest import fused_launches
from . import support

pytestmark = pytest.mark.gpu
pytest.importorskip("diffusers.models.transformers.transformer_z_image")


def _check(model: torch.nn.Module, inputs: dict, launches: int) -> None:
    with torch.inference_mode():
        expected = support.sample(model(**inputs))
        handle = enable(model)
        patched = support.sample(model(**inputs))
        count = fused_launches(lambda: model(**inputs))
        handle.disable()
    assert bits_equal(patched, expected)
    assert count == launches


def _cuda(inputs: dict) -> dict:
    return {k: [t.cuda() for t in v] if isinstance(v, list) else v.cuda() for k, v in inputs.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tiny_on_cuda(dtype: torch.dtype) -> None:
    model = support.transformer().to("cuda", dtype)
    _check(model, _cuda(support.step_inputs(dtype=dtype)), 0)


def _at_z_image_turbos_width(dtype: torch.dtype, batch: int) -> tuple[torch.nn.Module, dict]:
    """One main layer and one refiner of each kind at D = 3840; captions of 500 and 480 rows are
    padded (and masked) to 512."""
    model = support.transformer(
        dim=3840,
        n_heads=30,
        n_kv_heads=30,
        n_layers=1,
        cap_feat_dim=2560,
        in_channels=16,
        axes_dims=[32, 48, 48],
        axes_lens=[1024, 512, 512],
    ).to("cuda", dtype)
    gen = torch.Generator("cuda").manual_seed(0)
    inputs = {
        "x": [torch.randn(16, 1, 128, 128, generator=gen, device="cuda").to(dtype) for _ in range(batch)],
        "t": torch.full((batch,), 0.5, device="cuda"),
        "cap_feats": [
            torch.randn(n, 2560, generator=gen, device="cuda").to(dtype) for n in (500, 480)[:batch]
        ],
    }
    return model, inputs


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_at_z_image_turbos_width(dtype: torch.dtype, batch: int) -> None:
    """Each block's prologue is one launch, its sandwich norms three, its feed-forward's SwiGLU one."""
    _check(*_at_z_image_turbos_width(dtype, batch), 3 * 5)


def test_torchao_float8_per_row_sandwich_norms_quantize_for_the_linears() -> None:
    """torchao's per-row float8 on the blocks' Linears: the two sandwich sites a block whose next norm
    only float8 Linears read (q, k, v; w1 and w3) hand them their quantization from the site's own
    kernel, and the output is the quantized model's (random padding tokens: torchao quantizes
    diffusers' zero ones to NaN rows, which attention spreads to every output)."""
    quantization = pytest.importorskip("torchao.quantization")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs sm_89 or newer")
    model, inputs = _at_z_image_turbos_width(torch.bfloat16, 2)
    with torch.no_grad():
        model.x_pad_token.normal_()
        model.cap_pad_token.normal_()
    config = quantization.Float8DynamicActivationFloat8WeightConfig(granularity=quantization.PerRow())
    for stack in (model.layers, model.noise_refiner, model.context_refiner):
        quantization.quantize_(stack, config)
    with torch.inference_mode():
        expected = support.sample(model(**inputs))
        handle = enable(model)
        patched = support.sample(model(**inputs))
        sites = fused_launches(lambda: model(**inputs), ("sandwich_norm_kernel<__nv_bfloat16, true>",))
        handle.disable()
    assert not expected.isnan().all()
    assert bits_equal(patched, expected)
    assert sites == 2 * 3
