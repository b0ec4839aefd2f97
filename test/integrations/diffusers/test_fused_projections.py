"""diffusers' `fuse_qkv_projections()` (each attention's q, k and v in one `to_qkv` Linear, the text
stream's in `to_added_qkv`) on FLUX.1 and FLUX.2: `enable()` still gives diffusers' output bit for bit,
with every block through the block code, q, k and v taken as thirds of the fused Linear's output (as
diffusers' processors chunk it) and the separate projections never called. (FLUX.3's:
test/models/flux3/test_fused_projections.py.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from flux2_fused.integrations.diffusers import enable
from flux2_fused.models.flux1 import blocks as flux1_blocks
from flux2_fused.models.flux2 import Flux2Transformer
from flux2_fused.models.flux2 import blocks as flux2_blocks

from ...conftest import count_block_code
from ...models.flux1 import support as flux1
from ...models.flux2.test_model import TINY, diffusers_model, make_inputs

attention_backend = pytest.importorskip("diffusers.models.attention_dispatch").attention_backend


def _fuse(model: nn.Module) -> list[nn.Module]:
    """Every attention whose projections diffusers can fuse, fused; the separate q projections' calls
    are counted (none may happen)."""
    fused = []
    for module in model.modules():
        if getattr(module, "_supports_qkv_fusion", False):
            module.fuse_projections()
            assert module.fused_projections
            fused.append(module)
    return fused


def _flux1() -> tuple[nn.Module, dict]:
    return flux1.transformer(), flux1.step_inputs()


def _flux2() -> tuple[nn.Module, dict]:
    return diffusers_model(Flux2Transformer.random(TINY, seed=5)), make_inputs(TINY, 2, torch.float32, True)


@pytest.mark.parametrize(
    ("build", "family", "doubles"),
    [(_flux1, flux1_blocks, "transformer_blocks"), (_flux2, flux2_blocks, "transformer_blocks")],
    ids=["FLUX.1", "FLUX.2"],
)
def test_fused_projections_run_the_block_code(
    build: Callable[[], tuple[nn.Module, dict]], family: object, doubles: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, inputs = build()
    attns = _fuse(model)
    assert attns
    separate: list[int] = []
    for attn in attns:
        attn.to_q.register_forward_hook(lambda *_: separate.append(1))
    with torch.inference_mode(), attention_backend("native"):
        expected = model(**inputs, return_dict=False)[0]
        separate.clear()
        handle = enable(model)
        bodies = count_block_code(monkeypatch, "double_block_body", family)
        patched = model(**inputs, return_dict=False)[0]
        handle.disable()
    assert torch.equal(patched, expected)
    assert len(bodies) == len(getattr(model, doubles))
    assert separate == []
