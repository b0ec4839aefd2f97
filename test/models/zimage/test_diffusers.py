"""The Z-Image family on diffusers' ZImageTransformer2DModel (tiny, CPU): `enable()` reproduces
diffusers' forward bit for bit (fp32/bf16/fp16, batch 1 and 2 with captions of unequal length, so
padded and masked rows), runs every block (both refiners and the main layers) through the family's
block code, its attention prologue, sandwich norms and feed-forward SwiGLU as launches where the
kernels' references stand in for them, and leaves what it does not implement (per-token
modulation, other attention processors or arguments, hooked modules) to diffusers' own code."""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn

from flux2_fused.integrations.diffusers import enable
from flux2_fused.models.zimage import blocks
from flux2_fused.ops import bits_equal

from . import support

zimage = pytest.importorskip("diffusers.models.transformers.transformer_z_image")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _compare(model: nn.Module, inputs: dict[str, Any]) -> int:
    """diffusers' output and enable()'s are equal bit for bit; returns how many block calls the block
    code computed (not declined) in the patched call."""
    ran: list[bool] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        out = blocks.block_call(*args, **kwargs)
        ran.append(out is not None)
        return out

    with torch.inference_mode():
        expected = support.sample(model(**inputs))
        handle = enable(model)
        for cls in list(handle.host.block_forwards):  # the forward each block's fused forward runs
            handle.host.block_forwards[cls] = counting
        try:
            patched = support.sample(model(**inputs))
        finally:
            handle.disable()
    assert bits_equal(patched, expected)
    return sum(ran)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_is_diffusers_bit_for_bit(
    dtype: torch.dtype, batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = support.transformer().to(dtype)
    assert _compare(model, support.step_inputs(batch=batch, dtype=dtype)) == support.BLOCKS


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_fused_prologue_is_diffusers_bit_for_bit(
    dtype: torch.dtype, batch: int, prologue_on_cpu: list
) -> None:
    """Each block's q/k norms (diffusers' RMSNorm, eps 1e-5) and the complex rotation by its
    per-sample frequencies as one prologue launch: diffusers' bits."""
    model = support.transformer().to(dtype)
    assert _compare(model, support.step_inputs(batch=batch, dtype=dtype)) == support.BLOCKS
    assert prologue_on_cpu == [("complex", "mean", 1e-5, 1)] * support.BLOCKS


@pytest.fixture
def sandwich_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, bool, bool, bool]]:
    """The sandwich_norm 'kernel' as its reference (its contract), so the CPU runs the block code's
    fused sandwich sites at any width; one (update, gate, next norm, scale) entry a launch."""
    from flux2_fused.ops import sandwich_norm

    launches: list[tuple[bool, bool, bool, bool]] = []

    def fused(x, weight, eps, scale=None, update=None, update_weight=None, gate=None):
        launches.append((update is not None, gate is not None, weight is not None, scale is not None))
        return sandwich_norm.reference.sandwich(x, weight, eps, scale, update, update_weight, gate)

    monkeypatch.setattr(sandwich_norm, "fused", fused)
    return launches


@pytest.fixture
def swiglu_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The swiglu 'kernel' as its reference (its contract), so the CPU runs the feed-forward's fused
    SwiGLU; one entry a launch: whether its operands came as two tensors."""
    from flux2_fused.ops import swiglu

    launches: list[bool] = []

    def launch(x, out, b=None):
        launches.append(b is not None)
        result = swiglu.reference.swiglu(x) if b is None else swiglu.reference.swiglu(x, b)
        return result if out is None else out.copy_(result)

    monkeypatch.setattr(swiglu.guards.rows, "accepts", lambda *args: True)
    monkeypatch.setattr(swiglu, "_ROWS", dataclasses.replace(swiglu._ROWS, launch=launch))
    return launches


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_fused_sandwich_sites_are_diffusers_bit_for_bit(
    dtype: torch.dtype, batch: int, sandwich_on_cpu: list, prologue_on_cpu: list, swiglu_on_cpu: list
) -> None:
    """Every block's four sandwich norms as three launches (the first norm times the scale; the
    attention's gated update with the feed-forward's first norm and scale; the feed-forward's gated
    update), ungated and unscaled in the caption refiner, with the prologue and the feed-forward's
    SwiGLU of its two projections: diffusers' bits."""
    model = support.transformer().to(dtype)
    assert _compare(model, support.step_inputs(batch=batch, dtype=dtype)) == support.BLOCKS
    modulated = [(False, False, True, True), (True, True, True, True), (True, True, False, False)]
    plain = [(False, False, True, False), (True, False, True, False), (True, False, False, False)]
    refiners = support.TINY["n_refiner_layers"]
    expected = modulated * refiners + plain * refiners + modulated * support.TINY["n_layers"]
    assert sandwich_on_cpu == expected
    assert len(prologue_on_cpu) == support.BLOCKS
    assert swiglu_on_cpu == [True] * support.BLOCKS


def test_a_hooked_feed_forward_runs_its_own_call(swiglu_on_cpu: list) -> None:
    """A feed-forward with a hook is called as a module (the hook runs), the other blocks' SwiGLUs
    launch; diffusers' bits."""
    model = support.transformer().to(torch.bfloat16)
    seen: list[int] = []
    model.layers[0].feed_forward.register_forward_hook(lambda *_: seen.append(1))
    assert _compare(model, support.step_inputs(dtype=torch.bfloat16)) == support.BLOCKS
    assert len(seen) == 2 and swiglu_on_cpu == [True] * (support.BLOCKS - 1)


@pytest.mark.parametrize("where", ["class", "instance"])
def test_a_replaced_gating_runs_the_feed_forward_module(
    where: str, swiglu_on_cpu: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`_forward_silu_gating` replaced (on the class, or on one module) must run, so that
    feed-forward is the module's own call: the replacement's output, not the op's."""
    model = support.transformer()
    calls: list[int] = []

    def gating(self: nn.Module, x1: torch.Tensor, x3: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return torch.nn.functional.silu(x1) * x3 * 2.0

    if where == "class":
        monkeypatch.setattr(zimage.FeedForward, "_forward_silu_gating", gating)
    else:
        ff = model.layers[0].feed_forward
        ff._forward_silu_gating = gating.__get__(ff)
    inputs = support.step_inputs()
    with torch.inference_mode(), pytest.warns(RuntimeWarning) if where == "class" else nullcontext():
        expected = support.sample(model(**inputs))
        handle = enable(model)
        try:
            patched = support.sample(model(**inputs))
        finally:
            handle.disable()
    assert bits_equal(patched, expected)
    replaced = support.BLOCKS if where == "class" else 1
    assert len(calls) == 2 * replaced and len(swiglu_on_cpu) == support.BLOCKS - replaced


def test_a_hooked_sandwich_norm_runs_the_blocks_module_calls(sandwich_on_cpu: list) -> None:
    """A hook on one of a block's sandwich norms: that block's four norms are module calls (the hook
    runs), the other blocks' sites launch; diffusers' bits."""
    model = support.transformer().to(torch.bfloat16)
    seen: list[int] = []
    model.layers[0].ffn_norm2.register_forward_hook(lambda *_: seen.append(1))
    assert _compare(model, support.step_inputs(dtype=torch.bfloat16)) == support.BLOCKS
    assert len(seen) == 2 and len(sandwich_on_cpu) == 3 * (support.BLOCKS - 1)


def test_per_token_modulation_runs_diffusers_block() -> None:
    """The Omni models' per-token modulation (a noise mask) is not the block code's: None, so the
    class forward runs."""
    model = support.transformer()
    block = model.layers[0]
    x = torch.randn(1, 8, support.TINY["dim"])
    freqs = torch.polar(torch.ones(1, 8, 8), torch.rand(1, 8, 8))
    mask = torch.ones(1, 8, dtype=torch.long)
    assert blocks.block_call(block, None, None, x, None, freqs, None, mask, x[:, 0], x[:, 0]) is None
    assert blocks.block_call(block, None, None, x, None, None, x[:, 0]) is None


def test_a_hooked_attention_module_runs_its_own_call(
    prologue_on_cpu: list,
) -> None:
    """An attention module with a hook is called as a module (its processor's norms and rotation),
    the other blocks' prologues launch; diffusers' bits."""
    model = support.transformer().to(torch.bfloat16)
    seen: list[int] = []
    model.layers[1].attention.register_forward_hook(lambda *_: seen.append(1))
    assert _compare(model, support.step_inputs(dtype=torch.bfloat16)) == support.BLOCKS
    assert len(seen) == 2  # diffusers' call, then the block code's
    assert len(prologue_on_cpu) == support.BLOCKS - 1


def test_qk_norms_the_host_does_not_vouch_for_run_as_module_calls(
    prologue_on_cpu: list,
) -> None:
    """A q/k norm with a bias (not diffusers' plain RMSNorm as the prologue computes it): that block's
    norms are module calls and its rotation the processor's; diffusers' bits."""
    model = support.transformer().to(torch.bfloat16)
    norm = model.layers[0].attention.norm_k
    norm.bias = nn.Parameter(torch.randn_like(norm.weight))
    assert _compare(model, support.step_inputs(dtype=torch.bfloat16)) == support.BLOCKS
    assert len(prologue_on_cpu) == support.BLOCKS - 1


def test_another_attention_processor_runs_the_module(
    prologue_on_cpu: list,
) -> None:
    """A processor of another class (a user's) is the module's own call, in every block."""

    class Processor(zimage.ZSingleStreamAttnProcessor):
        pass

    model = support.transformer()
    for module in model.modules():
        if isinstance(module, zimage.Attention):
            module.set_processor(Processor())
    assert _compare(model, support.step_inputs()) == support.BLOCKS
    assert prologue_on_cpu == []


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_group_offload(offload_type: str, sandwich_on_cpu: list) -> None:
    """diffusers' group offloading (CPU to CPU here): a block wrapped whole runs the block code under
    the offload hooks; leaf-level hooks on the norms make them module calls (no longer plain)."""
    model = support.transformer()
    cpu = torch.device("cpu")
    kwargs = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
    model.enable_group_offload(onload_device=cpu, offload_device=cpu, offload_type=offload_type, **kwargs)
    assert _compare(model, support.step_inputs()) == support.BLOCKS
    assert len(sandwich_on_cpu) == (3 * support.BLOCKS if offload_type == "block_level" else 0)


def test_torch_compile_of_the_patched_transformer() -> None:
    """torch.compile of the patched transformer traces diffusers' forward and, inside it, each block's
    class forward (the fused block forward steps aside under a trace): diffusers' output."""
    model = support.transformer()
    inputs = support.step_inputs()
    with torch.inference_mode():
        expected = support.sample(model(**inputs))
        handle = enable(model)
        try:
            compiled = support.sample(torch.compile(model, backend="eager")(**inputs))
        finally:
            handle.disable()
            torch.compiler.reset()
    assert bits_equal(compiled, expected)


def test_fused_projections_run_the_attention_module(prologue_on_cpu: list) -> None:
    """`fuse_projections()` adds a fused qkv Linear that Z-Image's processor never uses: the attention
    runs as the module's own call, with its bits."""
    model = support.transformer()
    for module in model.modules():
        if isinstance(module, zimage.Attention):
            module.fuse_projections()
    assert _compare(model, support.step_inputs()) == support.BLOCKS
    assert prologue_on_cpu == []
