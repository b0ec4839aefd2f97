"""CPU tests of the Qwen-Image benchmark setup: `step --config qwen-image --host diffusers` is accepted,
the random transformer is reproducible from its seed, a LoRA reaches every block's projections and
modulations, and a quantized transformer gives the same output with `enable()`, every block through the
block code."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.bench import hosts, qwenimage
from flux2_fused.bench.options import diffusers_only

from ..conftest import count_block_code
from ..models.qwenimage import support

pytest.importorskip("diffusers.models.transformers.transformer_qwenimage")
CPU = torch.device("cpu")


def _tiny(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: object) -> torch.nn.Module:
    return qwenimage.random_transformer("qwen-image", CPU, dtype, seed=seed, **{**support.TINY, **overrides})


def test_the_config_is_a_diffusers_only_family() -> None:
    assert diffusers_only("qwen-image") == "Qwen-Image"


def test_the_random_transformer_is_reproducible() -> None:
    first, second = _tiny(seed=4), _tiny(seed=4, num_layers=1)
    assert len(second.transformer_blocks) == 1 and not second.training
    assert torch.equal(first.img_in.weight, second.img_in.weight)


def test_lora_adapts_every_blocks_projections_and_modulations() -> None:
    pytest.importorskip("peft")
    model = _tiny()
    hosts.add_lora(model, 2, targets=qwenimage.LORA_TARGETS)
    adapted = {
        name.rsplit(".base_layer", 1)[0] for name, _ in model.named_modules() if name.endswith("base_layer")
    }
    block = {
        name.removeprefix("transformer_blocks.0.")
        for name in adapted
        if name.startswith("transformer_blocks.0.")
    }
    attention = {
        f"attn.{t}"
        for t in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    }
    mlps = {f"{s}_mlp.net.{t}" for s in ("img", "txt") for t in ("0.proj", "2")}
    assert block == attention | mlps | {"img_mod.1", "txt_mod.1"}
    assert not any(name.startswith(("img_in", "txt_in", "proj_out")) for name in adapted)


def test_a_lora_with_a_scale_is_diffusers_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peft LoRA on every block's projections and modulations, called with a LoRA `scale`: diffusers'
    forward and enable()'s equal, the blocks through the block code."""
    pytest.importorskip("peft")
    model = _tiny()
    hosts.add_lora(model, 2, targets=qwenimage.LORA_TARGETS)
    bodies = count_block_code(monkeypatch, "double_block_body", support.FAMILY)
    inputs = {**support.step_inputs(), "attention_kwargs": {"scale": 0.7}}
    with torch.inference_mode():
        plain = model(**inputs, return_dict=False)[0]
        hosts.use_fused(model, True)
        fused = model(**inputs, return_dict=False)[0]
    assert torch.equal(fused, plain) and len(bodies) == support.TINY["num_layers"]


def test_the_quantized_host_switches_with_the_same_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--quantize int8` (torchao): diffusers' forward and enable()'s equal, the blocks through the
    block code."""
    pytest.importorskip("torchao")
    model = _tiny()
    hosts.quantize(model, "int8")
    assert type(model.transformer_blocks[0].attn.to_q.weight) is not torch.nn.Parameter
    bodies = count_block_code(monkeypatch, "double_block_body", support.FAMILY)
    inputs = support.step_inputs()
    with torch.inference_mode():
        plain = model(**inputs, return_dict=False)[0]
        hosts.use_fused(model, True)
        fused = model(**inputs, return_dict=False)[0]
    assert torch.equal(fused, plain) and len(bodies) == support.TINY["num_layers"]
