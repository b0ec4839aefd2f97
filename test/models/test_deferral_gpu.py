"""GPU tests: the fused model equals its eager path and diffusers bit for bit, with every site fused."""

from __future__ import annotations

import functools

import pytest
import torch

from flux2_fused.bench.hosts import diffusers_model
from flux2_fused.models.flux2 import Flux2Config, Flux2Transformer
from flux2_fused.ops import gated_resnorm

from .flux2.test_model import TINY, image_ids, text_ids

pytestmark = pytest.mark.gpu
attention_backend = pytest.importorskip("diffusers.models.attention_dispatch").attention_backend


@functools.cache
def _model(preset: str, dtype: torch.dtype) -> Flux2Transformer:
    """One model at a time (dev alone is 64 GB): building a new one drops the previous."""
    _model.cache_clear()
    torch.cuda.empty_cache()
    return Flux2Transformer.random(Flux2Config.preset(preset), seed=0, device="cuda", dtype=dtype)


def _inputs(config: Flux2Config, batch: int, img: int, txt: int, dtype: torch.dtype) -> dict:
    gen = torch.Generator(device="cuda")
    gen.seed()
    return {
        "hidden_states": torch.randn(batch, img, config.in_channels, generator=gen, device="cuda").to(dtype),
        "encoder_hidden_states": torch.randn(
            batch, txt, config.joint_attention_dim, generator=gen, device="cuda"
        ).to(dtype),
        "timestep": torch.rand(batch, generator=gen, device="cuda"),
        "img_ids": image_ids(img).cuda(),
        "txt_ids": text_ids(txt).cuda(),
        "guidance": torch.full((batch,), 4.0, device="cuda") if config.guidance_embeds else None,
    }


def _launch_counter(monkeypatch) -> dict:
    calls = {"launch": 0, "eager_norm": 0}
    launch, eager_norm = gated_resnorm.launch, gated_resnorm.modnorm_reference

    def counted_launch(*args, **kwargs):
        calls["launch"] += 1
        return launch(*args, **kwargs)

    def counted_norm(*args, **kwargs):
        calls["eager_norm"] += 1
        return eager_norm(*args, **kwargs)

    monkeypatch.setattr(gated_resnorm, "launch", counted_launch)
    monkeypatch.setattr(gated_resnorm, "modnorm_reference", counted_norm)
    monkeypatch.setattr(gated_resnorm.reference, "modnorm", counted_norm)
    return calls


CASES = [
    ("klein-4b", torch.bfloat16, 1, 4096, 512),
    ("klein-4b", torch.bfloat16, 2, 4096, 512),
    ("klein-4b", torch.bfloat16, 1, 1000, 77),
    ("klein-4b", torch.float16, 1, 4096, 512),
    ("dev", torch.bfloat16, 1, 4096, 512),
    ("dev", torch.bfloat16, 2, 4096, 512),
    ("dev", torch.bfloat16, 1, 1000, 77),
]


@pytest.mark.parametrize(("preset", "dtype", "batch", "img", "txt"), CASES, ids=lambda v: str(v))
def test_fused_equals_eager_equals_diffusers(preset, dtype, batch, img, txt, monkeypatch):
    model = _model(preset, dtype)
    config = model.config
    inputs = _inputs(config, batch, img, txt, dtype)
    calls = _launch_counter(monkeypatch)
    with torch.inference_mode():
        model.fused = True
        model(**inputs)  # warm-up: JIT load and self-check happen here
        calls.update(launch=0, eager_norm=0)
        fused = model(**inputs)
        fused_calls = dict(calls)
        model.fused = False
        eager = model(**inputs)
        model.fused = True
        with attention_backend("native"):
            reference = diffusers_model(model)(**inputs, return_dict=False)[0]
    assert torch.equal(fused, eager)
    assert torch.equal(fused, reference)
    assert fused.isfinite().all()
    sites = 4 * config.num_layers + config.num_single_layers + 1
    if dtype == torch.bfloat16:
        assert fused_calls == {"launch": sites, "eager_norm": 0}
    else:  # fp16: the clipped sites (text FFN residual, single blocks) are materialized, norms still fused
        assert fused_calls["launch"] == sites and fused_calls["eager_norm"] == 0


def test_cuda_graph_capture_of_the_fused_model():
    model = Flux2Transformer.random(TINY, seed=1, device="cuda", dtype=torch.bfloat16)
    inputs = _inputs(TINY, 2, 64, 16, torch.bfloat16)
    with torch.inference_mode():
        expected = model(**inputs)  # self-checks D=64 bf16 outside capture
        model.fused = False
        eager = model(**inputs)
        model.fused = True
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(**inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = model(**inputs)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(captured, expected) and torch.equal(expected, eager)
