"""CPU tests of the FLUX.1 benchmark setup: the random transformer is reproducible from its seed, its
LoRA targets exist in the blocks, and the pipeline benchmark's FluxPipeline call (FLUX.1's VAE, given
prompt embeddings) makes the same image with `enable()`, every block through the block code."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.bench import flux1, hosts
from flux2_fused.bench.pipeline import pipeline_call

from ..conftest import count_block_code
from ..models.flux1 import support
from .test_hosts import images_both_ways

pytest.importorskip("diffusers")
CPU = torch.device("cpu")


def test_the_random_transformer_is_reproducible_and_leaves_the_global_seed() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first = flux1.random_transformer("flux1-tiny", CPU, torch.float32, seed=4)
    after = torch.rand(1)
    second = flux1.random_transformer("flux1-tiny", CPU, torch.float32, seed=4, num_layers=1)
    assert torch.equal(before, after)
    assert len(second.transformer_blocks) == 1 and not second.training
    assert torch.equal(first.x_embedder.weight, second.x_embedder.weight)


def test_flux1_lora_targets_adapt_every_block_linear_the_step_uses() -> None:
    pytest.importorskip("peft")
    model = flux1.random_transformer("flux1-tiny", CPU, torch.float32)
    hosts.add_lora(model, 2, targets=flux1.LORA_TARGETS)
    adapted = {
        name.rsplit(".base_layer", 1)[0] for name, _ in model.named_modules() if name.endswith("base_layer")
    }
    assert "single_transformer_blocks.0.proj_out" in adapted and "proj_out" not in adapted
    assert (
        "transformer_blocks.0.ff.net.0.proj" in adapted and "transformer_blocks.0.attn.to_add_out" in adapted
    )


def test_the_pipeline_benchmarks_flux_pipeline_call_makes_the_same_image(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FLUX.1's 16-channel VAE packs 2x2 latents into 64 transformer channels, as flux1-dev's."""
    calls = count_block_code(monkeypatch, "double_block_body", support.FAMILY)
    transformer = flux1.random_transformer("flux1-tiny", CPU, torch.float32, in_channels=64)
    pipe = flux1.pipeline(transformer)
    call = pipeline_call(pipe, flux1.prompt_embeddings(transformer, 8), 64, 64, steps=2, guidance_scale=3.5)
    images = images_both_ways(pipe, call)
    assert images[True].shape == (1, 3, 64, 64) and torch.isfinite(images[True]).all()
    assert torch.equal(images[True], images[False])
    assert len(calls) == 2 * support.TINY["num_layers"]
