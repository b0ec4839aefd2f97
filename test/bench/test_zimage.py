"""CPU tests of the Z-Image benchmark setup: `step --config z-image-turbo --host diffusers` is accepted,
the random transformer is reproducible from its seed, and a LoRA reaches every block's projections,
feed-forward and modulation (the refiners' and the main layers')."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.bench import hosts, zimage
from flux2_fused.bench.options import diffusers_only
from flux2_fused.bench.step import sample

from ..models.zimage import support

pytest.importorskip("diffusers.models.transformers.transformer_z_image")
CPU = torch.device("cpu")


def _tiny(seed: int = 0, **overrides: object) -> torch.nn.Module:
    return zimage.random_transformer(
        "z-image-turbo", CPU, torch.float32, seed=seed, **{**support.TINY, **overrides}
    )


def test_the_config_is_a_diffusers_only_family() -> None:
    assert diffusers_only("z-image-turbo") == "Z-Image"


def test_the_random_transformer_is_reproducible() -> None:
    first, second = _tiny(seed=4), _tiny(seed=4, n_layers=1)
    assert len(second.layers) == 1 and not second.training
    assert torch.equal(
        first.noise_refiner[0].attention.to_q.weight, second.noise_refiner[0].attention.to_q.weight
    )


def test_lora_adapts_every_blocks_projections_and_modulation() -> None:
    pytest.importorskip("peft")
    model = _tiny()
    hosts.add_lora(model, 2, targets=zimage.LORA_TARGETS)
    adapted = {
        name.rsplit(".base_layer", 1)[0] for name, _ in model.named_modules() if name.endswith("base_layer")
    }
    block = {name.removeprefix("layers.0.") for name in adapted if name.startswith("layers.0.")}
    attention = {f"attention.{t}" for t in ("to_q", "to_k", "to_v", "to_out.0")}
    assert block == attention | {f"feed_forward.{t}" for t in ("w1", "w2", "w3")} | {"adaLN_modulation.0"}
    assert any(name.startswith("context_refiner.0.attention") for name in adapted)


def test_the_output_list_is_stacked() -> None:
    out = [torch.ones(2, 1, 3, 3), torch.zeros(2, 1, 3, 3)]
    assert sample(out).shape == (2, 2, 1, 3, 3)
    assert sample(out[0]) is out[0]


@pytest.mark.parametrize("setup", ["lora", "int8"])
def test_a_lora_or_int8_linears_give_diffusers_output(setup: str, prologue_on_cpu: list) -> None:
    """A peft LoRA on every block's projections (or torchao int8 linears): diffusers' forward and
    enable()'s equal, every block's attention through the block code (its prologue launched)."""
    pytest.importorskip("peft" if setup == "lora" else "torchao")
    model = _tiny()
    if setup == "lora":
        hosts.add_lora(model, 2, targets=zimage.LORA_TARGETS)
    else:
        hosts.quantize(model, "int8")
        assert type(model.layers[0].attention.to_q.weight) is not torch.nn.Parameter
    inputs = support.step_inputs()
    with torch.inference_mode():
        plain = support.sample(model(**inputs))
        hosts.use_fused(model, True)
        fused = support.sample(model(**inputs))
    assert torch.equal(fused, plain)
    assert len(prologue_on_cpu) == support.BLOCKS
