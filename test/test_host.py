"""The host interface (`flux2_fused.host`): both hosts implement it, and `plain` means what the block
code relies on: a class whose forward the family reproduces, with nothing hooking or wrapping it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flux2_fused.host import Host, ModuleHost, sdpa, unwrapped
from flux2_fused.models.flux2 import HOST, Flux2Config, Flux2Transformer

from .models.flux2.test_model import make_inputs

TINY = Flux2Config.preset("tiny")


def test_both_hosts_implement_the_protocol() -> None:
    from flux2_fused.integrations.diffusers import DiffusersHost
    from flux2_fused.models.flux2.diffusers import BINDING

    assert isinstance(HOST, Host) and isinstance(DiffusersHost(BINDING), Host)


def test_plain_needs_a_family_class_and_nothing_around_it() -> None:
    model = Flux2Transformer.random(TINY, seed=1)
    block = model.transformer_blocks[0]
    assert HOST.plain(block) and HOST.plain(block.ff) and HOST.plain(block.norm1)
    assert not HOST.plain(nn.GELU())  # not a class the block code reproduces
    handle = block.ff.register_forward_pre_hook(lambda m, a: None)
    assert not HOST.plain(block.ff) and not unwrapped(block.ff)
    handle.remove()
    block.norm2.forward = block.norm2.forward  # a forward set on the instance is a wrapper
    assert not HOST.plain(block.norm2)


def test_a_foreign_module_runs_its_own_call() -> None:
    """A feed-forward replaced by a module of another class is called, not computed by the block code."""

    class Doubled(nn.Module):
        def __init__(self, ff: nn.Module) -> None:
            super().__init__()
            self.ff = ff

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * self.ff(x)

    model = Flux2Transformer.random(TINY, seed=2)
    inputs = make_inputs(TINY, 1, torch.float32, guidance=True)
    with torch.no_grad():
        before = model(**inputs)
        block = model.transformer_blocks[0]
        block.ff = Doubled(block.ff)
        after = model(**inputs)
        block.ff = block.ff.ff
        assert torch.equal(model(**inputs), before)
    assert not torch.equal(after, before)


def test_module_host_attention_is_sdpa_only_without_options() -> None:
    host = ModuleHost(frozenset({nn.Identity}))
    assert host.attention(nn.Identity(), None, 0) is sdpa
    assert host.attention(nn.Identity(), {"scale": 2.0}, 0) is None
    assert host.attention(nn.Linear(2, 2), None, 0) is None
    assert "1 plain classes" in repr(host)


@pytest.mark.parametrize("heads", [1, 3])
def test_sdpa_takes_and_returns_token_major_tensors(heads: int) -> None:
    q, k, v = (torch.randn(2, 5, heads, 8) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
    assert torch.equal(sdpa(q, k, v), expected.transpose(1, 2).flatten(2, 3))
