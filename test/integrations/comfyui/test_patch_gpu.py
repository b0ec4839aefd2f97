"""ComfyUI's FLUX model on CUDA: `enable()` equals ComfyUI's own output bit for bit with the fused
kernels running (each modulated norm one launch, each SwiGLU or GELU one, each block's q/k norms and
RoPE one), with comfy-kitchen's CUDA RoPE and with its eager one, FLUX.2 at the tiny size and at
klein-4B's, FLUX.1 at the tiny size and at dev's; the
prologue kernel in each rotation equals ComfyUI's q/k norms and comfy-kitchen's RoPE on any bits."""

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
    """Our launches in one call: a double block's four modulated norms, two SwiGLUs (FLUX.1: GELUs) and
    its prologue, a single block's norm, SwiGLU (GELU) and prologue, the output norm."""
    return 7 * double + 3 * single + 1


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tiny_flux1_on_cuda(dtype: torch.dtype, rope_backend: str) -> None:
    """ComfyUI's FLUX.1 (each block's modulation, tanh-GELU MLPs through gelu_tanh, y, guidance)."""
    model = support.flux(dtype, device="cuda", **support.TINY_FLUX1)
    gen = torch.Generator("cuda").manual_seed(3)
    inputs = {
        **support.inputs(dtype, 2, device="cuda"),
        "y": torch.randn(2, support.TINY_FLUX1["vec_in_dim"], generator=gen, device="cuda").to(dtype),
        "guidance": torch.full((2,), 3.5, dtype=dtype, device="cuda"),
    }
    tiny = support.TINY_FLUX1
    _check(model, inputs, _sites(tiny["depth"], tiny["depth_single_blocks"]))


def test_flux1_dev_at_1024() -> None:
    """FLUX.1-dev's blocks (19 double, 38 single, 3072 wide) on a 1024x1024 latent with 512 text tokens,
    comfy-kitchen's CUDA RoPE."""
    from flux2_fused.bench import comfyui

    model = comfyui.random_model("flux1-dev", torch.device("cuda"), torch.bfloat16)
    inputs = comfyui.step_inputs(comfyui.preset_params("flux1-dev"), 1, 4096, 512, torch.bfloat16)
    _check(model, inputs, _sites(19, 38))


def test_klein_4b_at_1024(rope_backend: str) -> None:
    """klein-4B's blocks (5 double, 20 single, 3072 wide) on a 1024x1024 latent with 512 text tokens."""
    from flux2_fused.bench import comfyui
    from flux2_fused.models.flux2 import Flux2Config

    config = Flux2Config.preset("klein-4b")
    model = comfyui.random_model("klein-4b", torch.device("cuda"), torch.bfloat16)
    inputs = comfyui.step_inputs(comfyui.preset_params("klein-4b"), 1, 4096, 512, torch.bfloat16)
    _check(model, inputs, _sites(config.num_layers, config.num_single_layers))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_prologue_is_comfyuis_norms_and_rope_on_any_bits(dtype: torch.dtype, rope_backend: str) -> None:
    """ComfyUI's q/k RMSNorms (eps None) on its [B, H, S, hd] views of a qkv projection, then its
    `apply_rope` (comfy-kitchen live): the kernel in the rotation `rope_rotation` names gives the same
    bits, on random bit patterns in the rows and weights (subnormal norm outputs included) and on
    edge rows."""
    import comfy.ops
    from comfy.ldm.flux.math import apply_rope, rope

    from flux2_fused.integrations.comfyui.host import rope_rotation
    from flux2_fused.ops import bits_equal, random_bits
    from flux2_fused.ops.qk_norm_rope import Segment, qk_norm_rope, reference

    gen = torch.Generator("cuda").manual_seed(7)
    batch, tokens, heads = 2, 333, 3
    qkv = random_bits((batch, tokens, 3 * heads * 128), dtype, gen)
    qkv[0, :40] = torch.randn(40, 3 * heads * 128, generator=gen, device="cuda").to(dtype)
    qkv[0, 1] = 0.0
    qkv[0, 2] *= 1e-30 if dtype == torch.bfloat16 else 1e-4
    norms = [comfy.ops.disable_weight_init.RMSNorm(128, dtype=dtype, device="cuda") for _ in "qk"]
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(random_bits((128,), dtype, gen))
        norms[0].weight[:64] = torch.randn(64, generator=gen, device="cuda").to(dtype)
    ids = torch.randint(0, 64, (batch, tokens, 3), generator=gen, device="cuda")
    pe = torch.cat([rope(ids[..., i], d, 2000) for i, d in enumerate((32, 48, 48))], dim=-3).unsqueeze(1)
    q, k, _ = qkv.view(batch, tokens, 3, heads, 128).permute(2, 0, 3, 1, 4)
    with torch.inference_mode():
        expected = apply_rope(norms[0](q).to(q), norms[1](k).to(q), pe)
        rotation = rope_rotation(dtype, pe)
        assert rotation == {"cuda": "kitchen", "eager": "addcmul"}[rope_backend]
        rows = qkv.view(batch, tokens, 3, heads, 128).unbind(2)
        got = qk_norm_rope(
            [Segment(rows[0], norms[0].weight)],
            [Segment(rows[1], norms[1].weight)],
            *reference.comfy_tables(pe),
            eps=torch.finfo(torch.float32).eps,
            rotation=rotation,
        )
    for a, b in zip(got[:2], expected, strict=True):
        assert bits_equal(a.transpose(1, 2), b)


def test_a_replaced_kitchen_rope_runs_comfyuis_rotation(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tool that replaces comfy-kitchen's `apply_rope` (here: with a wrapper that halves k) is
    honored: the prologue does not launch, ComfyUI's rotation (the replacement) runs, ComfyUI's bits."""
    import comfy_kitchen

    from flux2_fused.integrations.comfyui.host import rope_rotation

    own = comfy_kitchen.apply_rope
    monkeypatch.setattr(comfy_kitchen, "apply_rope", lambda q, k, pe: own(q, k * 0.5, pe))
    pe = torch.zeros(1, 1, 3, 64, 2, 2, device="cuda")
    assert rope_rotation(torch.bfloat16, pe) is None
    model = support.flux(torch.bfloat16, device="cuda")
    tiny = support.TINY
    _check(
        model,
        support.inputs(torch.bfloat16, 2, device="cuda"),
        6 * tiny["depth"] + 2 * tiny["depth_single_blocks"] + 1,
    )


def test_training_mode_rotates_as_torch_unless_its_rope_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """In ComfyUI's training mode its FLUX RoPE is its own torch code (`_apply_rope1`): the prologue
    rotates as torch's addcmul does, and not at all where a tool replaced that code."""
    import comfy.ldm.flux.math as flux_math
    import comfy.model_management

    from flux2_fused.integrations.comfyui.host import rope_rotation

    pe = torch.zeros(1, 1, 3, 64, 2, 2, device="cuda")
    monkeypatch.setattr(comfy.model_management, "in_training", True)
    assert rope_rotation(torch.bfloat16, pe) == "addcmul"
    own = flux_math._apply_rope1
    monkeypatch.setattr(flux_math, "_apply_rope1", lambda x, freqs: own(x, freqs))
    assert rope_rotation(torch.bfloat16, pe) is None
