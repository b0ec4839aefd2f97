"""Caches and block-level tools stacked on a patched transformer of either family (FLUX.2's Klein
pipeline, FLUX.1's FluxPipeline): the same images as the tool alone, the same blocks executed (the
same skip decisions), and every executed block through the family's block code (its fused forward
under the tool, or the loop's body).

Each case builds a fresh tiny pipeline, applies the tool alone and runs a short denoise loop; then a
fresh pipeline with `enable()` before the tool, and one with `enable()` after it. A block counts as
executed when its body ran (fused) or its class forward's code ran (diffusers' own computation).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator
from types import FrameType, ModuleType

import pytest
import torch

from flux2_fused.bench.pipeline import apply_cache, computed_steps
from flux2_fused.integrations.diffusers import enable
from flux2_fused.models.flux1 import blocks as flux1_blocks
from flux2_fused.models.flux2 import blocks as flux2_blocks

from ...conftest import count_block_code
from ...models.flux1 import support as flux1
from ...models.flux2.test_model import TINY
from .test_pipelines import _pipeline, _run

diffusers = pytest.importorskip("diffusers")
transformer_flux2 = pytest.importorskip("diffusers.models.transformers.transformer_flux2")
transformer_flux = pytest.importorskip("diffusers.models.transformers.transformer_flux")

STEPS = 6
# The tiny configs with four blocks of each kind, so a cache's first and last compute blocks leave
# blocks in between to skip.
BLOCKS = {"num_layers": 4, "num_single_layers": 4}
CONFIG = dataclasses.replace(TINY, **BLOCKS)
ALL_BLOCKS = STEPS * 8  # every block, every step
Setup = Callable[[object], None]


@dataclasses.dataclass(frozen=True)
class Family:
    """A family's tiny pipeline (by diffusers class name), its call, its block classes and block code."""

    pipeline: Callable[[str], object]
    run: Callable[..., torch.Tensor]
    block_classes: tuple[type, ...]
    code: ModuleType
    default_pipeline: str


FAMILIES = {
    "flux2": Family(
        lambda name: _pipeline(getattr(diffusers, name), CONFIG),
        functools.partial(_run, guidance_scale=1.0),
        (transformer_flux2.Flux2TransformerBlock, transformer_flux2.Flux2SingleTransformerBlock),
        flux2_blocks,
        "Flux2KleinPipeline",
    ),
    "flux1": Family(
        lambda name: flux1.pipeline(getattr(diffusers, name), flux1.transformer(**BLOCKS)),
        flux1.run,
        (transformer_flux.FluxTransformerBlock, transformer_flux.FluxSingleTransformerBlock),
        flux1_blocks,
        "FluxPipeline",
    ),
}


@pytest.fixture(params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> Family:
    return FAMILIES[request.param]


@contextlib.contextmanager
def _count_class_forwards(family: Family) -> Iterator[list[int]]:
    """One entry each time a block's class forward (diffusers' own block computation) runs, seen by a
    profile function: replacing the classes' forwards to count them would be a class patch, which
    the fused path honors by running the replacement unfused."""
    calls: list[int] = []
    codes = {cls.forward.__code__ for cls in family.block_classes}

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code in codes:
            calls.append(1)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(previous)


def _run_with(
    family: Family, setup: Setup, enable_at: str | None, monkeypatch: pytest.MonkeyPatch, pipeline: str
) -> tuple[torch.Tensor, int, int]:
    """(images, blocks executed, of those through the block code) for a fresh pipeline with `setup`
    and enable() "first", "last" or not at all (None)."""
    with monkeypatch.context() as patch, _count_class_forwards(family) as diffusers_blocks:
        bodies = [count_block_code(patch, f"{kind}_block_body", family.code) for kind in ("double", "single")]
        pipe = family.pipeline(pipeline)
        handle = enable(pipe) if enable_at == "first" else None
        setup(pipe)
        handle = enable(pipe) if enable_at == "last" else handle
        images = family.run(pipe, num_inference_steps=STEPS)
        fused = sum(map(len, bodies))
        if handle is not None:
            handle.disable()
        return images, fused + len(diffusers_blocks), fused


def _check(family: Family, setup: Setup, monkeypatch: pytest.MonkeyPatch, pipeline: str | None = None) -> int:
    """The tool alone vs enable() before and after it, in `pipeline` (a diffusers class name, default
    the family's text-to-image pipeline); returns the blocks executed a run."""
    pipeline = pipeline or family.default_pipeline
    expected, executed, fused = _run_with(family, setup, None, monkeypatch, pipeline)
    assert fused == 0 and executed > 0
    for enable_at in ("first", "last"):
        images, patched_executed, patched_fused = _run_with(family, setup, enable_at, monkeypatch, pipeline)
        assert torch.equal(images, expected), enable_at
        assert patched_executed == executed, f"{enable_at}: other skip decisions than the tool alone"
        assert patched_fused == executed, f"{enable_at}: {executed - patched_fused} executed blocks not fused"
    return executed


# --------------------------------------------------------------------------- cache-dit


def _cache_dit(fn: int, bn: int, taylorseer: bool = False, on_transformer: bool = False) -> Setup:
    cache_dit = pytest.importorskip("cache_dit")

    def setup(pipe: object) -> None:
        config = cache_dit.DBCacheConfig(
            Fn_compute_blocks=fn, Bn_compute_blocks=bn, residual_diff_threshold=10.0, max_warmup_steps=1
        )
        calibrator = cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=1) if taylorseer else None
        target = pipe.transformer if on_transformer else pipe
        cache_dit.enable_cache(target, cache_config=config, calibrator_config=calibrator)

    return setup


@pytest.mark.parametrize(
    "fn, bn, taylorseer", [(1, 0, False), (1, 1, False), (2, 1, False), (1, 0, True)], ids=str
)
def test_cache_dit_dbcache(
    family: Family, fn: int, bn: int, taylorseer: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    executed = _check(family, _cache_dit(fn, bn, taylorseer), monkeypatch)
    assert executed < ALL_BLOCKS  # the cache skipped blocks: the comparison covers its decisions


def test_cache_dit_on_the_transformer(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _check(family, _cache_dit(1, 0, on_transformer=True), monkeypatch) < ALL_BLOCKS


def test_cache_dit_disable_cache_restores_the_pipeline(
    family: Family, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_dit = pytest.importorskip("cache_dit")

    def setup(pipe: object) -> None:
        _cache_dit(1, 0)(pipe)
        cache_dit.disable_cache(pipe)

    assert _check(family, setup, monkeypatch) == ALL_BLOCKS


# --------------------------------------------------------------------------- diffusers' caches


def _diffusers_cache(make_config: Callable[[object], object]) -> Setup:
    def setup(pipe: object) -> None:
        pipe.transformer.enable_cache(make_config(pipe))

    return setup


def test_mag_cache(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _diffusers_cache(
        lambda pipe: diffusers.MagCacheConfig(
            threshold=10.0,
            max_skip_steps=2,
            retention_ratio=0.2,
            num_inference_steps=STEPS,
            mag_ratios=[1.0] * STEPS,
        )
    )
    assert _check(family, config, monkeypatch) < ALL_BLOCKS


def test_taylorseer_cache(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _diffusers_cache(
        lambda pipe: diffusers.TaylorSeerCacheConfig(
            cache_interval=2, disable_cache_before_step=1, taylor_factors_dtype=torch.float32
        )
    )
    _check(family, config, monkeypatch)


def test_pyramid_attention_broadcast(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _diffusers_cache(
        lambda pipe: diffusers.PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 1000),
            current_timestep_callback=lambda: pipe.current_timestep,
        )
    )
    assert _check(family, config, monkeypatch) == ALL_BLOCKS  # it skips attentions inside the blocks


def test_faster_cache(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _diffusers_cache(
        lambda pipe: diffusers.FasterCacheConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 1000),
            current_timestep_callback=lambda: pipe.current_timestep,
            is_guidance_distilled=True,
        )
    )
    _check(family, config, monkeypatch)


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(
            "flux2",
            marks=pytest.mark.xfail(
                reason="diffusers 0.42.1's FirstBlockCache fails on FLUX.2 alone: its tail hook subtracts "
                "the double block's output tuple (diffusers issue #14280)",
                strict=True,
            ),
        ),
        "flux1",
    ],
    indirect=True,
)
def test_first_block_cache(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    _check(family, _diffusers_cache(lambda pipe: diffusers.FirstBlockCacheConfig(threshold=0.5)), monkeypatch)


# --------------------------------------------------------------------------- block-level offload


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_group_offload(family: Family, offload_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def setup(pipe: object) -> None:
        group = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
        pipe.transformer.enable_group_offload(
            onload_device=torch.device("cpu"),
            offload_device=torch.device("cpu"),
            offload_type=offload_type,
            **group,
        )

    assert _check(family, setup, monkeypatch) == ALL_BLOCKS


# --------------------------------------------------------------------------- the pipeline benchmark's caches


@pytest.mark.parametrize("cache", ["cache-dit", "magcache"])
@pytest.mark.parametrize(
    "family, pipeline",
    [("flux2", "Flux2KleinPipeline"), ("flux2", "Flux2Pipeline"), ("flux1", "FluxPipeline")],
    indirect=["family"],
)
def test_the_pipeline_benchmarks_caches(
    family: Family, cache: str, pipeline: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`flux2-fused pipeline --cache`: the fixed schedules skip blocks, identically with enable(), in
    the Klein models' pipeline, in dev's (Flux2Pipeline: embedded guidance, no cache context) and in
    FLUX.1's FluxPipeline."""
    if cache == "cache-dit":
        pytest.importorskip("cache_dit")
    executed = _check(family, lambda pipe: apply_cache(pipe, cache, STEPS), monkeypatch, pipeline)
    assert executed < ALL_BLOCKS
    assert computed_steps(8) == [1, 1, 0, 1, 0, 1, 0, 1]


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["cache-dit", "magcache"])
def test_caches_on_klein_4b_gpu(cache: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Klein pipeline with klein-4B (random weights, bf16, 512x512, 4 steps, CFG) under the pipeline
    benchmark's caches: the same image as the cache alone, the same blocks executed, every executed
    block through the block code."""
    if cache == "cache-dit":
        pytest.importorskip("cache_dit")
    from flux2_fused.bench import hosts
    from flux2_fused.bench.pipeline import pipeline_call, prompt_embeddings
    from flux2_fused.models.flux2 import Flux2Config

    config = Flux2Config.preset("klein-4b")
    steps = 4
    results = {}
    for enable_at in (None, "first", "last"):
        with monkeypatch.context() as patch:
            diffusers_blocks = _count_class_forwards(patch, FAMILIES["flux2"])
            bodies = [count_block_code(patch, f"{kind}_block_body") for kind in ("double", "single")]
            transformer = hosts.diffusers_host(config, torch.device("cuda"), torch.bfloat16)
            pipe = hosts.klein_pipeline(diffusers.Flux2KleinPipeline, transformer)
            handle = enable(pipe) if enable_at == "first" else None
            apply_cache(pipe, cache, steps)
            handle = enable(pipe) if enable_at == "last" else handle
            with torch.inference_mode():
                images = pipeline_call(
                    pipe, prompt_embeddings(pipe, config, 64), 512, 512, steps, 4.0
                )().cpu()
            fused = sum(map(len, bodies))
            results[enable_at] = (images, len(diffusers_blocks) + fused, fused)
            del pipe, transformer, handle
            torch.cuda.empty_cache()
    expected, executed, _ = results[None]
    every = 2 * steps * (config.num_layers + config.num_single_layers)  # two calls a step (CFG)
    print(f"{cache}: {executed} of {every} block calls executed")
    assert executed < every
    for enable_at in ("first", "last"):
        images, patched_executed, fused = results[enable_at]
        assert torch.equal(images, expected) and patched_executed == executed == fused, enable_at
