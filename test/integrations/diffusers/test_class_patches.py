"""Tools that patch diffusers' (or torch's) classes instead of instances, TeaCache's style: on FLUX.1,
FLUX.2 and FLUX.3, after `enable()` the patched code runs, whichever came first, and the output is
what diffusers gives with the same patch; the blocks the patched code does not touch stay on the
block code.

Each patch scales what its method returns, so an output that dropped it differs from diffusers'.
Most replacements are dressed with `functools.wraps` (the original's name, module and docstring),
as careful patch tools do: the check must see through that."""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from flux2_fused import host as host_module
from flux2_fused.integrations.diffusers import enable
from flux2_fused.models.flux1 import blocks as flux1_blocks
from flux2_fused.models.flux2 import Flux2Transformer
from flux2_fused.models.flux2 import blocks as flux2_blocks
from flux2_fused.models.flux3 import blocks as flux3_blocks

from ...conftest import count_block_code
from ...models.flux1 import support as flux1
from ...models.flux2.test_model import TINY, diffusers_model, image_ids, text_ids
from ...models.flux3 import support as flux3

attention_backend = pytest.importorskip("diffusers.models.attention_dispatch").attention_backend

FLUX2 = "diffusers.models.transformers.transformer_flux2"
FLUX1 = "diffusers.models.transformers.transformer_flux"
FLUX3 = "diffusers.models.transformers.transformer_flux3"
NORMS = "diffusers.models.normalization"


def _scaled(out: Any) -> Any:
    """A method's output with every tensor in it scaled (in place: the outputs are fresh tensors)."""
    if isinstance(out, torch.Tensor):
        return out.mul_(1.25)
    if isinstance(out, tuple):
        return tuple(_scaled(item) for item in out)
    out.sample.mul_(1.25)  # the transformer's output dataclass
    return out


def wrapped_replacement(original: Callable[..., Any]) -> Callable[..., Any]:
    """A replacement that calls the original and scales its output, dressed as the original."""

    @functools.wraps(original)
    def replacement(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _scaled(original(self, *args, **kwargs))

    return replacement


def teacache_style(original: Callable[..., Any]) -> Callable[..., Any]:
    """TeaCache4FLUX's way: `FluxTransformer2DModel.forward = teacache_forward`, a plain function of
    the user's script that keeps state on the model and runs the blocks itself (here through the
    original forward)."""

    def teacache_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        self.cnt = getattr(self, "cnt", 0) + 1
        return _scaled(original(self, *args, **kwargs))

    return teacache_forward


def call_replacement(original: Callable[..., Any]) -> Callable[..., Any]:
    """A `__call__` set on a block class, around `nn.Module.__call__`."""

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _scaled(original(self, *args, **kwargs))

    return __call__


@dataclass(frozen=True)
class Patch:
    """Replace `owner.name` with `make(the function there now)`; `blocks` says which kind of block
    (double, single) still runs the block code: a patch of the block's forward, or of a norm the
    fused sites compute, hands those blocks to diffusers; a `__call__` set on the block class runs
    around the block's fused forward, as a transformer forward does around the blocks it calls."""

    owner: str  # module.Class
    name: str
    make: Callable[[Callable[..., Any]], Callable[..., Any]]
    blocks: tuple[bool, bool] = (True, True)

    def cls(self) -> type:
        module, _, name = self.owner.rpartition(".")
        return getattr(importlib.import_module(module), name)

    def apply(self, monkeypatch: pytest.MonkeyPatch) -> None:
        cls = self.cls()
        monkeypatch.setattr(cls, self.name, self.make(getattr(cls, self.name)))


@dataclass(frozen=True)
class Family:
    """A family's tiny diffusers transformer, a call's inputs and its block code module."""

    model: Callable[[], nn.Module]
    inputs: Callable[[], dict[str, Any]]
    code: Any
    patches: dict[str, Patch]
    # The block bodies' names in the block code (the first kind, the joint single blocks) and how
    # many blocks of each kind one call runs.
    kinds: tuple[str, str] = ("double", "single")
    layers: Callable[[nn.Module], tuple[int, int]] = lambda model: (
        len(model.transformer_blocks),
        len(model.single_transformer_blocks),
    )


def _flux2_inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(11)
    return {
        "hidden_states": torch.randn(2, 37, TINY.in_channels, generator=gen),
        "encoder_hidden_states": torch.randn(2, 11, TINY.joint_attention_dim, generator=gen),
        "timestep": torch.rand(2, generator=gen),
        "img_ids": image_ids(37),
        "txt_ids": text_ids(11),
        "guidance": torch.full((2,), 4.0) if TINY.guidance_embeds else None,
    }


FAMILIES = {
    "flux2": Family(
        model=lambda: diffusers_model(Flux2Transformer.random(TINY, seed=5)),
        inputs=_flux2_inputs,
        code=flux2_blocks,
        patches={
            "transformer forward (TeaCache)": Patch(
                f"{FLUX2}.Flux2Transformer2DModel", "forward", teacache_style
            ),
            "double block forward": Patch(
                f"{FLUX2}.Flux2TransformerBlock", "forward", wrapped_replacement, (False, True)
            ),
            "single block forward": Patch(
                f"{FLUX2}.Flux2SingleTransformerBlock", "forward", wrapped_replacement, (True, False)
            ),
            "double block __call__": Patch(f"{FLUX2}.Flux2TransformerBlock", "__call__", call_replacement),
            "attention forward": Patch(f"{FLUX2}.Flux2Attention", "forward", wrapped_replacement),
            "single attention forward": Patch(
                f"{FLUX2}.Flux2ParallelSelfAttention", "forward", wrapped_replacement
            ),
            "processor __call__": Patch(f"{FLUX2}.Flux2AttnProcessor", "__call__", wrapped_replacement),
            "single processor __call__": Patch(
                f"{FLUX2}.Flux2ParallelSelfAttnProcessor", "__call__", wrapped_replacement
            ),
            "feed-forward forward": Patch(f"{FLUX2}.Flux2FeedForward", "forward", wrapped_replacement),
            "SwiGLU forward": Patch(f"{FLUX2}.Flux2SwiGLU", "forward", wrapped_replacement),
            "output norm forward": Patch(f"{NORMS}.AdaLayerNormContinuous", "forward", wrapped_replacement),
            "torch LayerNorm forward": Patch(
                "torch.nn.LayerNorm", "forward", wrapped_replacement, (False, False)
            ),
            "torch RMSNorm forward": Patch("torch.nn.RMSNorm", "forward", wrapped_replacement),
        },
    ),
    "flux1": Family(
        model=flux1.transformer,
        inputs=flux1.step_inputs,
        code=flux1_blocks,
        patches={
            "transformer forward (TeaCache)": Patch(
                f"{FLUX1}.FluxTransformer2DModel", "forward", teacache_style
            ),
            "double block forward": Patch(
                f"{FLUX1}.FluxTransformerBlock", "forward", wrapped_replacement, (False, True)
            ),
            "single block forward": Patch(
                f"{FLUX1}.FluxSingleTransformerBlock", "forward", wrapped_replacement, (True, False)
            ),
            "single block __call__": Patch(
                f"{FLUX1}.FluxSingleTransformerBlock", "__call__", call_replacement
            ),
            "attention forward": Patch(f"{FLUX1}.FluxAttention", "forward", wrapped_replacement),
            "processor __call__": Patch(f"{FLUX1}.FluxAttnProcessor", "__call__", wrapped_replacement),
            "feed-forward forward": Patch(
                "diffusers.models.attention.FeedForward", "forward", wrapped_replacement
            ),
            "GELU forward": Patch("diffusers.models.activations.GELU", "forward", wrapped_replacement),
            "modulation forward": Patch(
                f"{NORMS}.AdaLayerNormZero", "forward", wrapped_replacement, (False, True)
            ),
            "output norm forward": Patch(f"{NORMS}.AdaLayerNormContinuous", "forward", wrapped_replacement),
            "torch LayerNorm forward": Patch(
                "torch.nn.LayerNorm", "forward", wrapped_replacement, (False, False)
            ),
            "torch RMSNorm forward": Patch("torch.nn.RMSNorm", "forward", wrapped_replacement),
        },
    ),
    "flux3": Family(
        model=flux3.transformer,
        inputs=flux3.step_inputs,
        code=flux3_blocks,
        kinds=("mode", "single"),
        layers=lambda model: (
            len(model.txt_mode_blocks) + len(model.mode_blocks["image"]),
            len(model.single_transformer_blocks),
        ),
        patches={
            "transformer forward (TeaCache)": Patch(
                f"{FLUX3}.Flux3Transformer2DModel", "forward", teacache_style
            ),
            "mode block forward": Patch(
                f"{FLUX3}.Flux3ModeTransformerBlock", "forward", wrapped_replacement, (False, True)
            ),
            "single block forward": Patch(
                f"{FLUX3}.Flux3SingleTransformerBlock", "forward", wrapped_replacement, (True, False)
            ),
            "mode block __call__": Patch(f"{FLUX3}.Flux3ModeTransformerBlock", "__call__", call_replacement),
            "attention forward": Patch(f"{FLUX3}.Flux3Attention", "forward", wrapped_replacement),
            "processor __call__": Patch(f"{FLUX3}.Flux3AttnProcessor", "__call__", wrapped_replacement),
            "feed-forward forward": Patch(f"{FLUX3}.Flux3FeedForward", "forward", wrapped_replacement),
            "SwiGLU forward": Patch(f"{FLUX3}.Flux3SwiGLU", "forward", wrapped_replacement),
            "output norm forward": Patch(f"{FLUX3}.Flux3AdaLayerNorm", "forward", wrapped_replacement),
            "torch LayerNorm forward": Patch(
                "torch.nn.LayerNorm", "forward", wrapped_replacement, (False, False)
            ),
            "torch RMSNorm forward": Patch("torch.nn.RMSNorm", "forward", wrapped_replacement),
        },
    ),
}
CASES = [(family, patch) for family, spec in FAMILIES.items() for patch in spec.patches]


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test sees its replacements warned about (the package warns once per replacement)."""
    monkeypatch.setattr(host_module, "_warned_replacements", set())
    yield


def _bodies(monkeypatch: pytest.MonkeyPatch, family: Family) -> tuple[list[int], list[int]]:
    return tuple(count_block_code(monkeypatch, f"{kind}_block_body", family.code) for kind in family.kinds)


def _run(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.inference_mode(), attention_backend("native"):
        return model(**inputs, return_dict=False)[0]


@pytest.mark.parametrize("order", ["patch, then enable", "enable, then patch"])
@pytest.mark.parametrize(("family_name", "patch_name"), CASES)
def test_a_class_patch_runs_after_enable(
    family_name: str, patch_name: str, order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    family = FAMILIES[family_name]
    patch = family.patches[patch_name]
    model, inputs = family.model(), family.inputs()
    unpatched = _run(model, inputs)
    if order == "patch, then enable":
        with pytest.warns(RuntimeWarning, match="replaced on the class"):
            patch.apply(monkeypatch)
            handle = enable(model)
            double, single = _bodies(monkeypatch, family)
            patched = _run(model, inputs)
    else:
        handle = enable(model)
        double, single = _bodies(monkeypatch, family)
        assert torch.equal(_run(model, inputs), unpatched)  # fused before the patch
        double.clear(), single.clear()
        with pytest.warns(RuntimeWarning, match="replaced on the class"):
            patch.apply(monkeypatch)
            patched = _run(model, inputs)
    counts = (len(double), len(single))
    handle.disable()
    expected = _run(model, inputs)  # diffusers alone, with the same patch
    assert not torch.equal(expected, unpatched)  # the patch changes the output
    assert torch.equal(patched, expected)
    layers = family.layers(model)
    assert counts == tuple(n if fused else 0 for n, fused in zip(layers, patch.blocks, strict=True))


@pytest.mark.parametrize("family_name", FAMILIES)
def test_undoing_a_patch_fuses_again(family_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tool that restores the class (TeaCache's off switch, a context manager) gets the block code
    back on the next call."""
    family = FAMILIES[family_name]
    model, inputs = family.model(), family.inputs()
    handle = enable(model)
    expected = _run(model, inputs)
    double, single = _bodies(monkeypatch, family)
    with monkeypatch.context() as scoped, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        next(patch for patch in family.patches.values() if patch.blocks == (False, True)).apply(scoped)
        assert not torch.equal(_run(model, inputs), expected)
    assert not double
    single.clear()
    assert torch.equal(_run(model, inputs), expected)
    assert (len(double), len(single)) == family.layers(model)
    handle.disable()


def test_a_compiled_patched_model_sees_a_later_class_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile of the patched model guards on the classes' functions: a patch applied after
    compiling recompiles, and the compiled call then runs the replacement."""
    family = FAMILIES["flux2"]
    model, inputs = family.model(), family.inputs()
    handle = enable(model)
    torch.compiler.reset()
    compiled = torch.compile(model, backend="eager")
    before = _run(compiled, inputs)
    assert torch.equal(before, _run(model, inputs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        family.patches["feed-forward forward"].apply(monkeypatch)
        patched = _run(compiled, inputs)
    handle.disable()
    assert not torch.equal(patched, before)
    assert torch.equal(patched, _run(model, inputs))
    torch.compiler.reset()
