"""CPU tests of FLUX.2's norms handing torchao float8 Linears their input quantized (`Fusion.norm`'s
`float8_rows`): where every Linear reading a norm quantizes per row, the norm's quantizing form runs
(stood in for by torchao's quantization of eager's out, what the GPU tests prove the kernel writes)
and the output is torchao eager's; anything else reads the norm's values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flux2_fused.integrations.diffusers import enable
from flux2_fused.models.flux2 import Flux2Transformer

from ..float8_norms import float8_blocks, hook_attention, quantizing_norms
from .test_model import TINY, diffusers_model, make_inputs

pytest.importorskip("torchao.quantization.quantize_.workflows.float8.float8_tensor")
SITES = 4 * TINY.num_layers + TINY.num_single_layers  # a double block's four norms, a single block's one


def _model(kind: str, keep: tuple[str, ...] = ()) -> nn.Module:
    """The tiny diffusers FLUX.2 in bf16, its blocks' Linears torchao float8 (`kind` scales) but
    those whose names end with one of `keep`."""
    model = diffusers_model(Flux2Transformer.random(TINY, seed=5)).to(torch.bfloat16).eval()
    return float8_blocks(model, ("transformer_blocks.", "single_transformer_blocks."), kind, keep)


def _enabled_and_torchao(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = make_inputs(TINY, 2, torch.bfloat16, guidance=TINY.guidance_embeds)
    handle = enable(model)
    with torch.inference_mode():
        enabled = model(**inputs, return_dict=False)[0]
        handle.disable()
        expected = model(**inputs, return_dict=False)[0]
    return enabled, expected


@pytest.mark.parametrize(
    ("kind", "keep", "sites"),
    [
        ("row", (), SITES),
        ("row", ("attn.to_k",), SITES - TINY.num_layers),  # the image q/k/v norm: one Linear bf16
        ("row", ("ff_context.linear_in",), SITES - TINY.num_layers),
        ("row", ("attn.to_qkv_mlp_proj",), SITES - TINY.num_single_layers),
        ("tensor", (), 0),  # per tensor: the norm's values, quantized by the Linears
    ],
    ids=["every norm", "a bf16 to_k", "a bf16 text MLP", "bf16 single blocks", "per tensor"],
)
def test_norms_quantize_for_float8_linears_that_read_them_alone(kind, keep, sites, monkeypatch) -> None:
    calls = quantizing_norms(monkeypatch)
    enabled, expected = _enabled_and_torchao(_model(kind, keep))
    assert torch.equal(enabled, expected)
    assert len(calls) == sites


def test_an_attention_the_block_code_does_not_run_gets_the_norms_values(monkeypatch) -> None:
    """A hook on a double block's attention: its own call runs on the norm's values, computed from
    the stream where the norm came quantized (the same bits)."""
    calls = quantizing_norms(monkeypatch)
    model = _model("row")
    hook_attention(model.transformer_blocks[0])
    enabled, expected = _enabled_and_torchao(model)
    assert torch.equal(enabled, expected)
    assert calls  # the other sites still quantize
