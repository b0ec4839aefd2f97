"""The diffusers host picks a model's family by class (`registry`), never by class name."""

from __future__ import annotations

import re

import pytest
import torch

from flux2_fused.host import qualified_name
from flux2_fused.integrations.diffusers import FAMILIES, enable
from flux2_fused.integrations.diffusers.registry import binding_for
from flux2_fused.models.flux2 import Flux2Transformer
from flux2_fused.models.flux2.diffusers import BINDING

from ...models.flux2.test_model import TINY, diffusers_model

diffusers_flux2 = pytest.importorskip("diffusers.models.transformers.transformer_flux2")


def test_every_registered_class_and_binding_resolves() -> None:
    from flux2_fused.integrations.diffusers.host import Binding, resolve

    for qualified, module in FAMILIES.items():
        cls = resolve(qualified)
        binding = __import__(module, fromlist=["BINDING"]).BINDING
        assert cls is not None and isinstance(binding, Binding)
        assert all(
            resolve(name) is not None for name in (*binding.classes, *binding.processors, *binding.blocks)
        )
    assert set(FAMILIES.values()) == {
        "flux2_fused.models.flux2.diffusers",
        "flux2_fused.models.flux1.diffusers",
        "flux2_fused.models.flux3.diffusers",
        "flux2_fused.models.qwenimage.diffusers",
        "flux2_fused.models.zimage.diffusers",
    }


def test_diffusers_flux1_is_flux1_and_chroma_is_no_family() -> None:
    from flux2_fused.models.flux1.diffusers import BINDING as FLUX1

    from ...models.flux1 import support

    transformer_chroma = pytest.importorskip("diffusers.models.transformers.transformer_chroma")
    assert binding_for(support.transformer()) is FLUX1
    assert binding_for(torch.nn.Module.__new__(transformer_chroma.ChromaTransformer2DModel)) is None


def test_diffusers_flux2_and_its_subclasses_are_flux2() -> None:
    class Custom(diffusers_flux2.Flux2Transformer2DModel):
        pass

    assert binding_for(diffusers_model(Flux2Transformer.random(TINY, seed=1))) is BINDING
    assert binding_for(Custom(**TINY.to_diffusers())) is BINDING


def test_a_class_of_the_same_name_elsewhere_is_refused() -> None:
    """Another library's FLUX.2 transformer shares diffusers' class name: a name match is no proof
    that its modules compute what the block code reproduces."""

    class Flux2Transformer2DModel(torch.nn.Module):  # e.g. sglang's
        pass

    impostor = Flux2Transformer2DModel()
    assert binding_for(impostor) is None
    with pytest.raises(TypeError, match=re.escape(qualified_name(type(impostor)))):
        enable(impostor)
    with pytest.raises(TypeError, match="Flux2Transformer2DModel"):
        enable(object())


def test_the_handle_prints_in_one_line() -> None:
    model = diffusers_model(Flux2Transformer.random(TINY, seed=1))
    handle = enable(model)
    assert repr(handle) == (
        "FusedHandle(Flux2Transformer2DModel, fused=True, active, "
        "kernels off here: the fused ops run on CUDA GPUs, not on cpu)"
    )
    handle.disable()
    assert repr(handle) == "FusedHandle(Flux2Transformer2DModel, fused=True, disabled)"
