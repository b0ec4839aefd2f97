"""CPU tests of the benchmarks' diffusers host (bench.hosts) and of the pipeline benchmark's call: the
setups the GPU benchmarks time are built here at the tiny config, switched between diffusers' own
forward and enable(), and give the same outputs either way."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from flux2_fused.bench import hosts
from flux2_fused.bench.pipeline import pipeline_call, prompt_embeddings
from flux2_fused.models.flux2 import Flux2Config, Flux2Transformer

from ..models.flux2.test_model import make_inputs

diffusers = pytest.importorskip("diffusers")

TINY = Flux2Config.preset("tiny")
CPU = torch.device("cpu")


def test_diffusers_model_shares_the_package_models_weights() -> None:
    ours = Flux2Transformer.random(TINY, seed=2)
    theirs = hosts.diffusers_model(ours)
    storage = {name: t.data_ptr() for name, t in ours.state_dict().items()}
    assert {name: t.data_ptr() for name, t in theirs.state_dict().items()} == storage


def test_lora_adapts_every_named_linear() -> None:
    """Each target names Linears (the double block's `to_out` ModuleList is skipped, its `to_out.0`
    taken), and every block's projections and feed-forwards get an adapter."""
    pytest.importorskip("peft")
    model = hosts.diffusers_host(TINY, CPU, torch.float32, lora_rank=4)
    adapted = [name.removesuffix(".lora_A") for name, _ in model.named_modules() if name.endswith(".lora_A")]
    per_double = 8 + 2 * 2  # 8 attention projections; linear_in and linear_out of ff and ff_context
    assert len(adapted) == TINY.num_layers * per_double + TINY.num_single_layers * 2
    assert all(any(name.endswith(f".{t}") for t in hosts.LORA_TARGETS) for name in adapted)
    assert all(any(name.endswith(f".{t}") for name in adapted) for t in hosts.LORA_TARGETS)
    assert all(module.r["default"] == 4 for name, module in model.named_modules() if name in adapted)


@pytest.mark.parametrize("offload", hosts.OFFLOADS)
@pytest.mark.parametrize("lora_rank", [None, 4], ids=["plain", "lora"])
def test_the_diffusers_host_switches_between_diffusers_and_enable(
    offload: str, lora_rank: int | None, double_blocks: list[int]
) -> None:
    """What `flux2-fused step --host diffusers` alternates: diffusers' own forward (no block code)
    and enable()'s, on the model with its adapter and offload, with the same output. Block-level group
    offloading hooks every block: there each block runs its fused forward under the hook."""
    if lora_rank is not None:
        pytest.importorskip("peft")
    if offload == "model":
        pytest.importorskip("accelerate")
    model = hosts.diffusers_host(TINY, CPU, torch.float32, lora_rank, offload)
    inputs = make_inputs(TINY, 2, torch.float32, guidance=True)
    outputs = {}
    with torch.inference_mode():
        for fused in (False, True, False):
            before = len(double_blocks)
            hosts.use_fused(model, fused)
            outputs[fused] = model(**inputs, return_dict=False)[0]
            assert len(double_blocks) - before == (TINY.num_layers if fused else 0)
    assert torch.equal(outputs[True], outputs[False])


def images_both_ways(pipe: object, call: Callable[[], torch.Tensor]) -> dict[bool, torch.Tensor]:
    """The pipeline benchmark's call with diffusers' forward (False), then with `enable()` (True)."""
    with torch.inference_mode():
        images = {}
        for fused in (False, True):
            hosts.use_fused(pipe, fused)
            images[fused] = call()
    return images


def test_the_pipeline_benchmarks_call_makes_the_same_image_with_enable(double_blocks: list[int]) -> None:
    """The pipeline benchmark's Flux2KleinPipeline call (default VAE, CFG) at 64 px, with the tiny
    transformer widened to the VAE's 128 packed latent channels."""
    config = dataclasses.replace(TINY, in_channels=128, out_channels=128)
    transformer = hosts.diffusers_host(config, CPU, torch.float32)
    pipe = hosts.klein_pipeline(diffusers.Flux2KleinPipeline, transformer)
    call = pipeline_call(pipe, prompt_embeddings(pipe, 8), 64, 64, steps=2, guidance_scale=4.0)
    images = images_both_ways(pipe, call)
    assert images[True].shape == (1, 3, 64, 64) and torch.isfinite(images[True]).all()
    assert torch.equal(images[True], images[False])
    assert len(double_blocks) == 2 * 2 * TINY.num_layers  # two steps of two calls (CFG)


def test_the_quantized_diffusers_host_switches_with_the_same_output(double_blocks: list[int]) -> None:
    """`flux2-fused step --host diffusers --quantize int8`: torchao's dynamic int8 linears in the blocks
    (the float8 ones need a GPU), diffusers' forward and enable()'s equal, the blocks fused around them."""
    pytest.importorskip("torchao")
    model = hosts.diffusers_host(TINY, CPU, torch.float32, quantization="int8")
    assert type(model.transformer_blocks[0].attn.to_q.weight) is not torch.nn.Parameter
    inputs = make_inputs(TINY, 2, torch.float32, guidance=True)
    with torch.inference_mode():
        plain = model(**inputs, return_dict=False)[0]
        hosts.use_fused(model, True)
        fused = model(**inputs, return_dict=False)[0]
    assert torch.equal(fused, plain) and len(double_blocks) == TINY.num_layers


def test_quantizing_leaves_inductors_settings() -> None:
    """torchao's configs would turn on Inductor's coordinate-descent autotuning (minutes a compiled
    float8 step); the benchmark's quantization leaves Inductor's settings as they were."""
    pytest.importorskip("torchao")
    import torch._inductor.config as inductor

    from flux2_fused.bench import hosts
    from flux2_fused.models.flux2 import Flux2Config, Flux2Transformer

    model = hosts.diffusers_model(Flux2Transformer.random(Flux2Config.preset("tiny"), seed=0))
    before = inductor.coordinate_descent_tuning
    hosts.quantize(model, "int8")
    assert inductor.coordinate_descent_tuning == before
    weight = model.transformer_blocks[0].attn.to_q.weight
    assert type(weight) is not torch.nn.Parameter  # a torchao quantized tensor
