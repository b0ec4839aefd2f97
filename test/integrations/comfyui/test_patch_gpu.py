"""ComfyUI's FLUX.2 model on CUDA: `enable()` equals ComfyUI's own output bit for bit with the fused
kernels running (each modulated norm one launch, each SwiGLU one), with comfy-kitchen's CUDA RoPE and
with its eager one, at the tiny size and at klein-4B's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ...conftest import fused_launches
from . import support

pytestmark = pytest.mark.gpu

support.import_comfy()

from flux2_fused.integrations.comfyui import enable  # noqa: E402


def _sites(double: int, single: int) -> int:
    """Our launches in one call: a double block's four modulated norms and two SwiGLUs, a single
    block's norm and SwiGLU, the output norm (ComfyUI's q/k norms and RoPE stay its own)."""
    return 6 * double + 2 * single + 1


@pytest.fixture(params=["cuda", "eager"], ids=["kitchen-cuda", "kitchen-eager"])
def rope_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """comfy-kitchen's RoPE backend: its CUDA kernel (what ComfyUI picks on torch cu130) or its eager
    one (torch ops), by disabling the CUDA backend for the test."""
    import comfy_kitchen

    if request.param == "eager":
        comfy_kitchen.registry.disable("cuda")
    try:
        yield request.param
    finally:
        if request.param == "eager":
            comfy_kitchen.registry.enable("cuda")


def _check(model: torch.nn.Module, inputs: dict, sites: int) -> None:
    with torch.inference_mode():
        expected = model(**inputs)
        handle = enable(model)
        fused = model(**inputs)
        launches = fused_launches(lambda: model(**inputs))
        handle.disable()
    assert torch.equal(fused, expected)
    assert launches == sites


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tiny_model_on_cuda(dtype: torch.dtype, batch: int, rope_backend: str) -> None:
    model = support.flux(dtype, device="cuda")
    tiny = support.TINY
    _check(
        model, support.inputs(dtype, batch, device="cuda"), _sites(tiny["depth"], tiny["depth_single_blocks"])
    )


def test_klein_4b_at_1024(rope_backend: str) -> None:
    """klein-4B's blocks (5 double, 20 single, 3072 wide) on a 1024x1024 latent with 512 text tokens."""
    from flux2_fused.bench import comfyui
    from flux2_fused.models.flux2 import Flux2Config

    config = Flux2Config.preset("klein-4b")
    model = comfyui.random_model("klein-4b", torch.device("cuda"), torch.bfloat16)
    inputs = comfyui.step_inputs(config, 1, 4096, 512, torch.bfloat16)
    _check(model, inputs, _sites(config.num_layers, config.num_single_layers))
