"""GPU tests of the eager FLUX.2 transformer: bit-exact diffusers parity on CUDA, up to the full dev model.

diffusers reaches the GPU machine as a carried wheel, hence the import-or-skip (through the CPU test
module, whose helpers these tests share).
"""

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from flux2_fused.models.flux2 import Flux2Config, Flux2Transformer

from .test_model import TINY, image_ids, make_inputs, run_both, text_ids

pytestmark = pytest.mark.gpu

# 1024x1024 in the pipeline: a 64x64 grid of image tokens, 512 text tokens.
N_IMG_FULL, N_TXT_FULL = 64 * 64, 512


def to_cuda(inputs: dict) -> dict:
    return {key: None if value is None else value.cuda() for key, value in inputs.items()}


@pytest.fixture(autouse=True)
def free_gpu_memory() -> Iterator[None]:
    """Give the caching allocator's memory back after each test: dev alone needs 64 GB."""
    yield
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("guidance_embeds", [True, False], ids=["guidance", "no-guidance"])
def test_tiny_parity_cuda(dtype: torch.dtype, batch: int, guidance_embeds: bool) -> None:
    config = dataclasses.replace(TINY, guidance_embeds=guidance_embeds)
    ours = Flux2Transformer.random(config, seed=3, device="cuda", dtype=dtype)
    ours_out, ref_out = run_both(ours, to_cuda(make_inputs(config, batch, dtype, guidance=guidance_embeds)))
    assert ours_out.is_cuda
    assert torch.equal(ours_out, ref_out)


@pytest.mark.parametrize("preset", ["klein-4b", "dev"])
def test_full_size_parity_1024px(preset: str) -> None:
    """Random weights built on the GPU; diffusers shares their storage; one bf16 step at 1024x1024."""
    config = Flux2Config.preset(preset)
    ours = Flux2Transformer.random(config, seed=0, device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16_cuda = {"dtype": torch.bfloat16, "device": "cuda"}
    inputs = {
        "hidden_states": torch.randn(1, N_IMG_FULL, config.in_channels, generator=gen, **bf16_cuda),
        "encoder_hidden_states": torch.randn(
            1, N_TXT_FULL, config.joint_attention_dim, generator=gen, **bf16_cuda
        ),
        "timestep": torch.rand(1, generator=gen, device="cuda"),
        "img_ids": image_ids(N_IMG_FULL).cuda(),
        "txt_ids": text_ids(N_TXT_FULL).cuda(),
        "guidance": torch.full((1,), 4.0, device="cuda") if config.guidance_embeds else None,
    }
    ours_out, ref_out = run_both(ours, inputs)
    del ours
    assert ours_out.shape == (1, N_IMG_FULL, config.out_channels)
    assert ours_out.isfinite().all()
    assert 0.1 < ours_out.float().std().item() < 10
    assert torch.equal(ours_out, ref_out)


def test_from_pretrained_onto_cuda(tmp_path: Path) -> None:
    ours = Flux2Transformer.random(TINY, seed=4)
    ours.save_pretrained(tmp_path, max_shard_bytes=40_000)
    loaded = Flux2Transformer.from_pretrained(tmp_path, device="cuda", dtype=torch.bfloat16)
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in loaded.parameters())
    expected = {key: t.to("cuda", torch.bfloat16) for key, t in ours.state_dict().items()}
    assert all(torch.equal(t, expected[key]) for key, t in loaded.state_dict().items())
