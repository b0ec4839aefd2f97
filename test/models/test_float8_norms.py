"""CPU tests of FLUX.1's, FLUX.3's, Z-Image's and Qwen-Image's norms handing torchao float8 Linears
their input quantized (`Fusion.norm`'s and `Fusion.joint_norm`'s `float8_rows`, Z-Image's
`normed_site`; FLUX.2's are in
flux2/test_float8_norms.py): where every Linear reading a norm quantizes per row, the norm's
quantizing form runs (stood in for, `float8_norms.quantizing_norms`) and diffusers' model through
`enable()` gives torchao eager's output; a norm with any other reader, per-tensor Linears and an
attention the block code does not run read the norm's values."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from flux2_fused.integrations.diffusers import enable

from .float8_norms import float8_blocks, hook_attention, quantizing_norms
from .flux1 import support as flux1
from .flux3 import support as flux3
from .qwenimage import support as qwenimage
from .zimage import support as zimage

pytest.importorskip("torchao.quantization.quantize_.workflows.float8.float8_tensor")
attention_backend = pytest.importorskip("diffusers.models.attention_dispatch").attention_backend
BF16 = torch.bfloat16


@dataclass(frozen=True)
class Family:
    """A tiny diffusers model of one family: how to build it and its inputs (bf16), which modules
    hold its blocks' Linears, how many norm sites a call runs, and one Linear (a name's end) that
    reads a norm with the number of norm sites it reads."""

    model: Callable[[], nn.Module]
    inputs: Callable[[], dict[str, Any]]
    blocks: tuple[str, ...]
    sites: Callable[[nn.Module], int]
    reader: tuple[str, Callable[[nn.Module], int]]
    output: Callable[[Any], torch.Tensor] = lambda out: out[0]


def _with_pad_tokens(model: nn.Module) -> nn.Module:
    """Z-Image with random padding tokens: torchao quantizes diffusers' zero ones to a NaN row (a zero
    amax, a zero scale), which attention spreads to every output, so the outputs would compare NaNs."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("pad_token"):
                p.normal_()
    return model


FAMILIES = {
    # Double blocks: norm1, norm1_context (q, k, v), norm2, norm2_context (the MLPs); single: norm.
    "flux1": Family(
        lambda: flux1.transformer().to(BF16),
        lambda: flux1.step_inputs(dtype=BF16),
        ("transformer_blocks.", "single_transformer_blocks."),
        lambda m: 4 * len(m.transformer_blocks) + len(m.single_transformer_blocks),
        ("proj_mlp", lambda m: len(m.single_transformer_blocks)),
    ),
    # A mode block's norm (its attention and MLP) per mode; a joint single block's twin norms, one.
    "flux3": Family(
        lambda: flux3.transformer(dtype=BF16),
        lambda: flux3.step_inputs(dtype=BF16),
        ("txt_mode_blocks.", "mode_blocks.", "single_transformer_blocks."),
        lambda m: 2 * len(m.txt_mode_blocks) + len(m.single_transformer_blocks),
        ("txt_mode_blocks.0.attn.to_v", lambda m: 1),
    ),
    "flux3 reference image": Family(
        lambda: flux3.transformer(dtype=BF16),
        lambda: flux3.step_inputs(dtype=BF16, references=1),
        ("txt_mode_blocks.", "mode_blocks.", "single_transformer_blocks."),
        lambda m: 3 * len(m.txt_mode_blocks) + len(m.single_transformer_blocks),
        ("single_transformer_blocks.0.ff.linear_in", lambda m: 1),
    ),
    # A block's two sandwich sites with a next norm (q, k, v; w1 and w3): the main layers, both refiners.
    "z-image": Family(
        lambda: _with_pad_tokens(zimage.transformer().to(BF16)),
        lambda: zimage.step_inputs(dtype=BF16),
        ("layers.", "noise_refiner.", "context_refiner."),
        lambda m: 2 * (len(m.layers) + len(m.noise_refiner) + len(m.context_refiner)),
        ("layers.0.feed_forward.w3", lambda m: 1),
        zimage.sample,
    ),
    "qwen-image": Family(
        lambda: qwenimage.transformer().to(BF16),
        lambda: qwenimage.step_inputs(dtype=BF16),
        ("transformer_blocks.",),
        lambda m: 4 * len(m.transformer_blocks),
        ("txt_mlp.net.0.proj", lambda m: len(m.transformer_blocks)),
    ),
}


def _torchao_and_enabled(family: Family, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = family.inputs()

    def run() -> torch.Tensor:
        return family.output(model(**inputs, return_dict=False))

    with torch.inference_mode(), attention_backend("native"):
        expected = run()
        handle = enable(model)
        try:
            enabled = run()
        finally:
            handle.disable()
    return expected, enabled


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("case", ["every norm", "a bf16 reader", "per tensor"])
def test_norms_quantize_for_float8_linears_that_read_them_alone(name: str, case: str, monkeypatch) -> None:
    family = FAMILIES[name]
    calls = quantizing_norms(monkeypatch)
    model = family.model()
    keep = (family.reader[0],) if case == "a bf16 reader" else ()
    float8_blocks(model, family.blocks, "tensor" if case == "per tensor" else "row", keep)
    expected, enabled = _torchao_and_enabled(family, model)
    assert torch.equal(enabled, expected)
    sites = {
        "every norm": family.sites(model),
        "a bf16 reader": family.sites(model) - family.reader[1](model),
    }
    assert len(calls) == sites.get(case, 0)


@pytest.mark.parametrize("name", ["flux1", "flux3", "z-image", "qwen-image"])
def test_an_attention_the_block_code_does_not_run_gets_the_norms_values(name: str, monkeypatch) -> None:
    """A hook on the first block's attention: its own call runs on the norm's values, computed from
    the stream where the norm came quantized (the same bits); the other norms still quantize."""
    family = FAMILIES[name]
    calls = quantizing_norms(monkeypatch)
    model = float8_blocks(family.model(), family.blocks, "row")
    first = {"flux3": "txt_mode_blocks", "z-image": "layers"}.get(name, "transformer_blocks")
    hook_attention(getattr(model, first)[0])
    expected, enabled = _torchao_and_enabled(family, model)
    assert torch.equal(enabled, expected)
    assert calls


def test_flux3s_twin_norms_quantize_both_segments(monkeypatch) -> None:
    """A joint single block's twin norms are one quantizing call over the text and content rows."""
    calls = quantizing_norms(monkeypatch)
    family = FAMILIES["flux3"]
    model = float8_blocks(family.model(), family.blocks, "row")
    expected, enabled = _torchao_and_enabled(family, model)
    assert torch.equal(enabled, expected)
    assert calls.count(2) == len(model.single_transformer_blocks)
