"""The host interface (`flux2_fused.host`): both hosts implement it, and `plain` means what the block
code relies on: a class whose forward the family reproduces, with nothing hooking or wrapping it."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

from flux2_fused import host as host_module
from flux2_fused.host import Host, ModuleHost, methods_unpatched, sdpa, unwrapped
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


class _Library(nn.Module):
    """A class as a library writes it: its forward under a decorator of torch's."""

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _dressed(original):
    @functools.wraps(original)  # the original's name, module, qualname and docstring
    def forward(self, x):
        return original(self, x) * 2

    return forward


class _Callable:
    def __call__(self, module, x):
        return x


# Replacements of a library class's forward (torch's SiLU) from outside that library.
REPLACEMENTS = {
    "a function dressed with functools.wraps": lambda cls: _dressed(cls.forward),
    "a lambda": lambda cls: lambda self, x: x,
    "another class's method of the same module": lambda cls: nn.Sigmoid.forward,
    "a function of another torch module": lambda cls: nn.Identity.forward,
    "a callable object": lambda cls: _Callable(),
    # torch's own wrappers that change the arithmetic: the block code must not skip them
    "torch.autocast around the original": lambda cls: torch.autocast("cpu", torch.bfloat16)(cls.forward),
    "torch.compile of the original": lambda cls: torch.compile(cls.forward),
}


def test_library_classes_with_their_own_decorated_methods_are_unpatched() -> None:
    for cls in (_Library, nn.SiLU, nn.LayerNorm, nn.RMSNorm):
        assert methods_unpatched(cls)


@pytest.mark.parametrize("replacement", REPLACEMENTS)
def test_a_method_replaced_on_the_class_is_seen_and_undoing_it_too(
    replacement: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(host_module, "_warned_replacements", set())
    original = nn.SiLU.forward
    with monkeypatch.context() as scoped:
        scoped.setattr(nn.SiLU, "forward", REPLACEMENTS[replacement](nn.SiLU))
        with pytest.warns(RuntimeWarning, match=r"SiLU.forward is replaced on the class"):
            assert not methods_unpatched(nn.SiLU)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per replacement
            assert not methods_unpatched(nn.SiLU)
    assert nn.SiLU.forward is original and methods_unpatched(nn.SiLU)


def test_a_replaced_call_or_a_replaced_base_method_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """`__call__` counts as much as `forward`, wherever along the MRO it is replaced."""
    monkeypatch.setattr(host_module, "_warned_replacements", set())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with monkeypatch.context() as scoped:
            scoped.setattr(nn.SiLU, "__call__", lambda self, x: x)
            assert not methods_unpatched(nn.SiLU) and methods_unpatched(nn.SiLU, ("forward",))
        with monkeypatch.context() as scoped:
            scoped.setattr(nn.Module, "__call__", lambda self, *args: None)
            assert not methods_unpatched(nn.SiLU)
    assert methods_unpatched(nn.SiLU)


def test_plain_is_false_for_a_patched_class(monkeypatch: pytest.MonkeyPatch) -> None:
    block = Flux2Transformer.random(TINY, seed=1).transformer_blocks[0]
    monkeypatch.setattr(host_module, "_warned_replacements", set())
    monkeypatch.setattr(nn.LayerNorm, "forward", _dressed(nn.LayerNorm.forward))
    with pytest.warns(RuntimeWarning, match="replaced on the class"):
        assert not HOST.plain(block.norm1)
    assert HOST.plain(block) and HOST.plain(block.ff)
