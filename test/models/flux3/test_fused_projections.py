"""FLUX.3's attention after diffusers' `fuse_projections()`, which puts q, k and v in one `to_qkv`
Linear: the block code takes them as thirds of its output, as `Flux3AttnProcessor` chunks them, so it
gives the module's own output bit for bit with its fp32 prologue running and the separate projections
unused: on a `ModuleHost` of FLUX.3's attention, and through `enable()` on the whole model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flux2_fused.host import ModuleHost
from flux2_fused.integrations.diffusers import enable
from flux2_fused.models.deferral import Fusion
from flux2_fused.models.flux3 import image_ids, text_ids

from ...conftest import count_block_code
from . import support

transformer_flux3 = pytest.importorskip("diffusers.models.transformers.transformer_flux3")
attention_backend = pytest.importorskip("diffusers.models.attention_dispatch").attention_backend


def _fuse(model: nn.Module) -> list[nn.Module]:
    """Every Flux3Attention of the model with its projections fused, as `fuse_qkv_projections` users do."""
    attns = [m for m in model.modules() if isinstance(m, transformer_flux3.Flux3Attention)]
    for attn in attns:
        attn.fuse_projections()
        assert attn.fused_projections
    return attns


def _calls(module: nn.Module) -> list[int]:
    calls: list[int] = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block", ["txt_mode_blocks", "single_transformer_blocks"])
def test_the_block_code_takes_q_k_v_from_the_fused_linear(
    dtype: torch.dtype, block: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = support.transformer(dtype=dtype)
    _fuse(model)
    attn = getattr(model, block)[0].attn
    ids = torch.cat([text_ids(5), image_ids(3, 3)])
    rope = model.pos_embed(ids)
    h = torch.randn(2, len(ids), attn.query_dim, generator=torch.Generator().manual_seed(7)).to(dtype)
    with torch.inference_mode(), attention_backend("native"):
        expected = attn(hidden_states=h, image_rotary_emb=rope)
        fused, separate = _calls(attn.to_qkv), _calls(attn.to_q)
        prologues = count_block_code(monkeypatch, "prologue", support.FAMILY)
        host = ModuleHost(frozenset({transformer_flux3.Flux3Attention, nn.RMSNorm}))
        got = support.FAMILY.attention(attn, host, Fusion(), h, rope)
    assert torch.equal(got, expected)
    assert (len(fused), len(separate), len(prologues)) == (1, 0, 1)


def test_enable_gives_diffusers_output_with_fused_projections(monkeypatch: pytest.MonkeyPatch) -> None:
    model = support.transformer()
    attns = _fuse(model)
    assert len(attns) == 3 * support.TINY["num_layers"] + support.TINY["num_single_layers"]
    inputs = support.step_inputs(references=1)
    with torch.inference_mode(), attention_backend("native"):
        expected = model(**inputs).sample
        handle = enable(model)
        prologues = count_block_code(monkeypatch, "prologue", support.FAMILY)
        patched = model(**inputs).sample
        handle.disable()
    assert torch.equal(patched, expected)
    assert len(prologues) == len(attns)  # every attention through the block code's prologue
