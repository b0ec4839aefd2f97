"""CPU tests of the FLUX.3 benchmark setup: the random transformer is reproducible from its seed, a LoRA
and a quantization reach every block stack (the text and image mode blocks too, not only the joint
blocks), the pipeline's VAE follows the transformer, and the pipeline benchmark's calls of diffusers'
FLUX.3 modular pipelines (CFG through the guider, and the step-distilled flow map) make the same image
with `enable()`, every block through the block code."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.bench import flux3, hosts
from flux2_fused.bench.pipeline import pipeline_call, prompt_embeddings

from ..conftest import count_block_code
from ..models.flux3 import support
from .test_hosts import images_both_ways

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("diffusers.models.transformers.transformer_flux3")
CPU = torch.device("cpu")
# Where each block stack's Linears sit: the text mode blocks, the image modes' (a ModuleDict by mode),
# the joint single blocks.
STACKS = ("txt_mode_blocks.", "mode_blocks.image.", "mode_blocks.image_cond.", "single_transformer_blocks.")


def test_the_random_transformer_keeps_its_qk_norms_in_fp32() -> None:
    """`hosts.random_transformer` (reproducible, the global seed untouched: FLUX.1's test), with
    FLUX.3's q/k norms moved to fp32 as its loader keeps them."""
    first = flux3.random_transformer("flux3-tiny", CPU, torch.bfloat16, seed=4)
    second = flux3.random_transformer("flux3-tiny", CPU, torch.bfloat16, seed=4, num_single_layers=1)
    assert len(second.single_transformer_blocks) == 1 and not second.training
    assert torch.equal(first.context_embedder.weight, second.context_embedder.weight)
    attn = first.single_transformer_blocks[0].attn
    assert attn.norm_q.weight.dtype == torch.float32 and attn.to_q.weight.dtype == torch.bfloat16


def test_flux3_lora_adapts_every_block_stacks_linears() -> None:
    pytest.importorskip("peft")
    model = flux3.random_transformer("flux3-tiny", CPU, torch.float32)
    hosts.add_lora(model, 2, targets=flux3.LORA_TARGETS)
    adapted = {
        name.rsplit(".base_layer", 1)[0] for name, _ in model.named_modules() if name.endswith("base_layer")
    }
    for stack in STACKS:
        layers = {name for name in adapted if name.startswith(f"{stack}0.")}
        assert layers == {f"{stack}0.attn.{t}" for t in ("to_q", "to_k", "to_v", "to_out.0")} | {
            f"{stack}0.ff.{t}" for t in ("linear_in", "linear_out")
        }, stack
    assert not any(name.startswith(("context_embedder", "x_embedders", "proj_out")) for name in adapted)


def test_the_quantized_flux3_host_switches_with_the_same_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """`flux2-fused step --config flux3-klein --host diffusers --quantize int8` (the float8 ones need a
    GPU): every block stack's Linears quantized, the embedders plain, diffusers' forward and
    enable()'s equal, the blocks through the block code."""
    pytest.importorskip("torchao")
    model = flux3.random_transformer("flux3-tiny", CPU, torch.float32)
    hosts.quantize(model, "int8")
    for stack in STACKS:
        linear = model.get_submodule(f"{stack}0.attn.to_q")
        assert type(linear.weight) is not torch.nn.Parameter, stack  # a torchao quantized tensor
    assert type(model.context_embedder.weight) is torch.nn.Parameter
    single = count_block_code(monkeypatch, "single_block_body", support.FAMILY)
    inputs = support.step_inputs(references=1)
    with torch.inference_mode():
        plain = model(**inputs, return_dict=False)[0]
        hosts.use_fused(model, True)
        fused = model(**inputs, return_dict=False)[0]
    assert torch.equal(fused, plain) and len(single) == support.TINY["num_single_layers"]


def test_the_vae_follows_the_transformer() -> None:
    """FLUX.3 [klein]'s 128 input channels take AutoencoderKLFlux2's default (32 latent channels, 2x2
    packed); the test sizes a small VAE with a quarter of the transformer's channels."""
    klein = flux3.random_transformer("flux3-klein", torch.device("meta"), torch.bfloat16)
    assert flux3.vae_config(klein) == {}
    tiny = flux3.random_transformer("flux3-tiny", CPU, torch.float32)
    assert flux3.vae_config(tiny) == {**flux3.SMALL_VAE, "latent_channels": support.TINY["in_channels"] // 4}


@pytest.mark.parametrize("flow_map", [False, True], ids=["cfg", "flow-map"])
def test_the_pipeline_benchmarks_flux3_call_makes_the_same_image(
    flow_map: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pipeline benchmark's call at 32 x 48 (2 x 3 tokens), two steps: Flux3ModularPipeline with
    the benchmark's guidance scale on its guider and a negative prompt (two calls a step), or the
    distilled pipeline without a guider (one call a step)."""
    pytest.importorskip("transformers")  # the FLUX.3 modular pipelines' classes need it
    mode = count_block_code(monkeypatch, "mode_block_body", support.FAMILY)
    transformer = flux3.random_transformer("flux3-tiny", CPU, torch.float32, flow_map=flow_map)
    pipe = flux3.pipeline(transformer, guidance_scale=4.5)
    prompts = prompt_embeddings(pipe, 8)
    if flow_map:
        assert getattr(pipe, "guider", None) is None and set(prompts) == {"prompt_embeds"}
    else:
        assert pipe.guider.guidance_scale == 4.5
        assert set(prompts) == {"prompt_embeds", "negative_prompt_embeds"}
    call = pipeline_call(pipe, prompts, 32, 48, steps=2, guidance_scale=4.5)
    images = images_both_ways(pipe, call)
    assert images[True].shape == (1, 3, 32, 48) and torch.isfinite(images[True]).all()
    assert torch.equal(images[True], images[False])
    calls = 2 * (1 if flow_map else 2)
    assert len(mode) == calls * 2 * support.TINY["num_layers"]
