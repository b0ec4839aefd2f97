"""ComfyUI's own FLUX.2 model: `enable()` on ComfyUI's `Flux` gives ComfyUI's output bit for bit, with
every block through the family's block code (on the CPU the ops run their eager chains; with the
guards forced to accept, the fused branches; the GPU tests run the kernels), and every call the block
code does not implement runs ComfyUI's own forward, with a warning that says why."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

from ...conftest import compiled_targets, count_block_code
from . import support

flux_module = support.import_comfy()

from flux2_fused.integrations.comfyui import enable  # noqa: E402
from flux2_fused.models.flux2 import comfyui as binding  # noqa: E402


def _bodies(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    return [
        count_block_code(monkeypatch, name, binding) for name in ("double_block_body", "single_block_body")
    ]


def _run(model: torch.nn.Module, **kwargs: Any) -> torch.Tensor:
    with torch.inference_mode():
        return model(**kwargs)


def _compare(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> None:
    """ComfyUI's output, then enable()'s with every block through the block code: equal bits."""
    expected = _run(model, **kwargs)
    handle = enable(model)
    doubles, singles = _bodies(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no call may decline
        patched = _run(model, **kwargs)
    handle.disable()
    assert torch.equal(patched, expected)
    assert (len(doubles), len(singles)) == (support.TINY["depth"], support.TINY["depth_single_blocks"])
    assert torch.equal(_run(model, **kwargs), expected)  # disabled: ComfyUI's own forward


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_comfyui_output_bit_for_bit(dtype: torch.dtype, batch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _compare(support.flux(dtype), monkeypatch, **support.inputs(dtype, batch))


def test_reference_latents_and_guidance(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLUX.2 dev's guidance embedding, and an edit's reference latents (their rows join the image's;
    the output keeps the image's)."""
    dtype = torch.bfloat16
    model = support.flux(dtype, guidance_embed=True)
    kwargs = support.inputs(dtype)
    kwargs["guidance"] = torch.full((2,), 3.5, dtype=dtype)
    kwargs["ref_latents"] = [support.inputs(dtype, seed=5, height=4, width=3)["x"]]
    _compare(model, monkeypatch, **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_fused_branches_are_comfyui_bit_for_bit(
    dtype: torch.dtype, gated_resnorm_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the norm's guards accepting (its reference as the kernel, rounding as addcmul does): each
    modulated norm one launch, pending residuals consumed by the next norm, ComfyUI's bits."""
    _compare(support.flux(dtype), monkeypatch, **support.inputs(dtype))
    tiny = support.TINY
    assert len(gated_resnorm_on_cpu) == 4 * tiny["depth"] + tiny["depth_single_blocks"] + 1


@pytest.fixture
def prologue_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """ComfyUI's RoPE taken as torch's "addcmul" rotation (what `rope_rotation` says where comfy-kitchen
    runs its eager backend) and the qk_norm_rope 'kernel' as its reference over the same segments (the
    kernel's contract), so the CPU runs the binding's fused prologue: the tables from ComfyUI's
    rotation matrices, the norms' weights and eps, text rows first. One entry (the rotation) a launch."""
    from flux2_fused.ops import qk_norm_rope

    launches: list[str] = []

    def fused(q, k, cos, sin, eps, v=None, *, upcast=False, rotation="aten", norm="fused"):
        launches.append(rotation)
        mode = {"upcast": upcast, "rotation": rotation, "norm": norm}
        return qk_norm_rope.reference.prologue(q, k, cos, sin, eps, v, **mode)

    monkeypatch.setattr(binding, "rope_rotation", lambda dtype, pe: "addcmul")
    monkeypatch.setattr(qk_norm_rope, "fused", fused)
    return launches


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_fused_prologue_is_comfyui_bit_for_bit(
    dtype: torch.dtype, batch: int, prologue_on_cpu: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every block's q/k norms and ComfyUI's rotation as one prologue launch: ComfyUI's bits (its q/k
    RMSNorms without eps take float32's machine epsilon, as aten does)."""
    model = support.flux(dtype)
    assert all(block.img_attn.norm.query_norm.eps is None for block in model.double_blocks)
    _compare(model, monkeypatch, **support.inputs(dtype, batch))
    tiny = support.TINY
    assert prologue_on_cpu == ["addcmul"] * (tiny["depth"] + tiny["depth_single_blocks"])


def test_the_prologue_leaves_norms_that_cast_per_call_to_comfyui(
    prologue_on_cpu: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """q/k norms whose weights ComfyUI casts per call (`manual_cast`) are not vouched for: the norms
    run as modules and ComfyUI's own `apply_rope` rotates, no prologue launch."""
    import comfy.ops

    _compare(support.flux(operations=comfy.ops.manual_cast), monkeypatch, **support.inputs())
    assert prologue_on_cpu == []


def _declines(model: torch.nn.Module, reason: str, **kwargs: Any) -> None:
    """ComfyUI's own forward runs the call, with a warning naming `reason`, and gives its bits."""
    expected = _run(model, **kwargs)
    handle = enable(model)
    with pytest.warns(RuntimeWarning, match=reason):
        patched = _run(model, **kwargs)
    handle.disable()
    assert torch.equal(patched, expected)


def _flux1_inputs(dtype: torch.dtype = torch.bfloat16, batch: int = 2) -> dict[str, torch.Tensor]:
    """FLUX.1's call: the latent, timesteps and text, its pooled-text vector y and the guidance."""
    gen = torch.Generator().manual_seed(9)
    return {
        **support.inputs(dtype, batch),
        "y": torch.randn(batch, support.TINY_FLUX1["vec_in_dim"], generator=gen).to(dtype),
        "guidance": torch.full((batch,), 3.5, dtype=dtype),
    }


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_flux1_output_bit_for_bit(dtype: torch.dtype, batch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """ComfyUI's FLUX.1 (each block's own modulation, tanh-GELU MLPs, biases, y and guidance) on the
    block code: ComfyUI's bits."""
    _compare(support.flux(dtype, **support.TINY_FLUX1), monkeypatch, **_flux1_inputs(dtype, batch))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_flux1_fused_branches_are_comfyui_bit_for_bit(
    dtype: torch.dtype, gated_resnorm_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """FLUX.1's modulated norms (each block's own modulation) as fused launches, the GELU through the
    gelu_tanh op: ComfyUI's bits."""
    gelu = []
    from flux2_fused.ops import gelu_tanh

    for name in ("apply", "concat"):
        op = getattr(gelu_tanh, name)
        monkeypatch.setattr(
            gelu_tanh, name, lambda *args, _op=op, _name=name, **kw: gelu.append(_name) or _op(*args, **kw)
        )
    _compare(support.flux(dtype, **support.TINY_FLUX1), monkeypatch, **_flux1_inputs(dtype))
    tiny = support.TINY_FLUX1
    assert len(gated_resnorm_on_cpu) == 4 * tiny["depth"] + tiny["depth_single_blocks"] + 1
    assert sorted(gelu) == sorted(["apply"] * 2 * tiny["depth"] + ["concat"] * tiny["depth_single_blocks"])


def test_block_replacements_run_comfyui_forward() -> None:
    def replace(args: dict, extra: dict) -> dict:
        return extra["original_block"](args)

    options = {"patches_replace": {"dit": {("double_block", 0): replace}}}
    _declines(support.flux(), "block replacements", **support.inputs(), transformer_options=options)


def test_attention_patches_run_comfyui_forward() -> None:
    options = {"patches": {"attn1_output_patch": [lambda attn, extra: attn * 1]}}
    _declines(support.flux(), "attn1_output_patch", **support.inputs(), transformer_options=options)


def test_a_hooked_block_runs_comfyui_forward() -> None:
    model = support.flux()
    model.single_blocks[1].register_forward_hook(lambda module, args, out: out)
    _declines(model, "single block", **support.inputs())


def test_a_replaced_rope_function_runs_comfyui_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    import comfy.ldm.flux.math as flux_math

    real = flux_math.apply_rope
    monkeypatch.setattr(flux_math, "apply_rope", lambda q, k, pe: real(q, k, pe))
    _declines(support.flux(), "RoPE function is replaced", **support.inputs())


def test_enable_refuses_other_models() -> None:
    with pytest.raises(TypeError, match="ComfyUI's FLUX model"):
        enable(torch.nn.Linear(2, 2))


def test_switch_off_runs_every_site_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    model = support.flux()
    expected = _run(model, **support.inputs())
    handle = enable(model, fused=False)
    doubles, _ = _bodies(monkeypatch)
    assert torch.equal(_run(model, **support.inputs()), expected)
    assert len(doubles) == support.TINY["depth"]
    assert "fused=False" in repr(handle)


def test_torch_compile_of_the_patched_model() -> None:
    """torch.compile of the patched model (what ComfyUI's TorchCompileModel node compiles): the fused
    sites become flux2_fused operators in the graph, and run eagerly the graph gives ComfyUI's bits."""
    model = support.flux()
    inputs = support.inputs()
    expected = _run(model, **inputs)
    handle = enable(model)
    compiled, targets = compiled_targets(model, lambda compiled_model: _run(compiled_model, **inputs))
    handle.disable()
    assert {
        torch.ops.flux2_fused.gated_resnorm.default,
        torch.ops.flux2_fused.modnorm.default,
        torch.ops.flux2_fused.swiglu.default,
    } <= targets
    assert torch.equal(compiled, expected)


def test_fp8_weights_cast_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """float8 weights under ComfyUI's `manual_cast` ops (what it runs for fp8 checkpoints computed in
    bf16): every Linear and q/k norm casts its weight per call, as the node calls them as modules."""
    import comfy.ops

    model = support.flux(torch.float8_e4m3fn, operations=comfy.ops.manual_cast)
    assert next(model.parameters()).dtype == torch.float8_e4m3fn
    _compare(model, monkeypatch, **support.inputs(torch.bfloat16))


def test_another_tools_forward_orig_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward_orig another tool put on the model (IP-Adapter and prompt-weighting nodes do) stays and
    runs: enable() leaves it, says so, and comes back inactive."""
    model = support.flux()
    calls: list[int] = []

    def theirs(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return type(model).forward_orig(model, *args, **kwargs)

    model.forward_orig = theirs
    expected = _run(model, **support.inputs())
    with pytest.warns(RuntimeWarning, match="forward_orig is already replaced"):
        handle = enable(model)
    assert not handle.active and model.forward_orig is theirs
    assert torch.equal(_run(model, **support.inputs()), expected) and len(calls) == 2


@pytest.mark.parametrize(
    "variant",
    [
        {"global_modulation": False, "mlp_silu_act": False, "yak_mlp": True, "txt_norm": True},
        {"mlp_silu_act": False},
    ],
    ids=["ovis-image", "shared-modulation-gelu"],
)
def test_other_flux_variants_decline_before_their_blocks_are_read(variant: dict[str, bool]) -> None:
    """A FLUX variant the block code does not implement (Ovis-Image's gated MLPs; shared modulation
    with GELU MLPs) falls back with a reason, never an error from reading its blocks."""
    _declines(support.flux(**variant), "not a FLUX.1 or FLUX.2 model", **support.inputs(), y=None)


def test_a_deep_copy_is_patched_for_itself_and_a_second_handle_keeps_its_patch() -> None:
    model = support.flux()
    enable(model)
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for param in copied.parameters():
            param.mul_(1.5)
    inputs = support.inputs()
    patched = _run(copied, **inputs)
    del copied.__dict__["forward_orig"]
    assert torch.equal(patched, _run(copied, **inputs))  # the copy's own weights, not the original's
    first, second = enable(model), enable(model)
    first.disable()
    assert model.forward_orig is second.forward and second.active


def test_an_attention_override_runs_comfyui_forward() -> None:
    def override(func: Any, *args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    options = {"optimized_attention_override": override}
    _declines(support.flux(), "attention override", **support.inputs(), transformer_options=options)


def test_an_attention_library_the_node_has_not_checked_declines(monkeypatch: pytest.MonkeyPatch) -> None:
    """sage, flash-attn or xformers as ComfyUI's attention: the node has not checked them with its q, k,
    v layout, so ComfyUI's own forward runs (the reason checked here; the libraries are not installed)."""
    import comfy.ldm.flux.math as flux_math
    import comfy.ldm.modules.attention as attention

    assert binding.model_reason(support.flux(), {}) is None
    monkeypatch.setattr(flux_math, "optimized_attention", attention.attention_xformers)
    assert "attention library" in binding.model_reason(support.flux(), {})
