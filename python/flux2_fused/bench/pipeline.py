"""Whole-pipeline benchmark: a diffusers FLUX pipeline call, alone vs with `enable(pipe)`.

    flux2-fused pipeline [--config klein-4b dev flux1-dev flux3-klein ...] [--pairs N] [--steps N]
                         [--height PX --width PX] [--text-tokens N] [--guidance-scale S]
                         [--cache none cache-dit magcache] [--json FILE]

What a user of diffusers sees end to end: for the Klein models Flux2KleinPipeline's denoise loop
with classifier-free guidance (two transformer calls a step, prompt and negative prompt embeddings),
for dev Flux2Pipeline's (one call a step, the guidance scale embedded), for FLUX.1 FluxPipeline's (one
call a step; dev embeds the guidance, schnell has none), for FLUX.3 [klein] diffusers' FLUX.3 modular
pipeline's (`Flux3ModularPipeline`: CFG through its guider, two calls a step; the flow map's
`Flux3DistilledModularPipeline`: one call a step given the timestep it jumps to), the scheduler, the
VAE decode and the image postprocessing, all of diffusers' code, with only the transformer's forward
patched. Random weights: the package's random transformer as diffusers' Flux2Transformer2DModel
(`bench.hosts`), or diffusers' FluxTransformer2DModel and Flux3Transformer2DModel at their own default
init (`bench.flux1`, `bench.flux3`), diffusers' AutoencoderKLFlux2 at its default config (FLUX.1:
AutoencoderKL at FLUX.1's), the default FlowMatchEulerDiscreteScheduler (FLUX.3: its blocks' own,
FLUX.3's shift); random prompt embeddings stand in for the text encoder, which is not part of the
call's transformer work and is not built (FLUX.3's prompt upsampler neither).

One pipeline, switched between diffusers' forward and enable() call by call (interleaved as the step
benchmark's pairs), after a warm-up call of each (the fused one self-checks). Each call starts on an
idle GPU and is waited for, as a user's call ends with an image to use. The images (output_type "pt")
of the warm-up calls are compared with torch.equal.

With `--cache`, the cache is set up on the pipeline before the first call (and stays through both
modes): cache-dit's DBCache, or diffusers' MagCache, each with a fixed schedule of skipped steps, so
both modes make the same decisions whatever the random weights give (not on FLUX.3, whose blocks
neither cache knows yet). The fused kernel launches of one profiled enable() call measure the fused
work the cache left: the time saved over the fused launches is the saving per fused site, comparable
with the run without a cache.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.metadata
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import asdict

import torch

from ..errors import BadValue
from ..models.flux2 import Flux2Config
from . import flux1, flux3, hosts
from .options import check_side, diffusers_only, require_at_least_one
from .results.pipeline import PipelineResult, format_pipeline_table
from .results.tables import Timing, write_json
from .step import kernel_breakdown, tensor_sha256, time_synchronized


def pipeline_class(config: Flux2Config) -> type:
    """The pipeline a FLUX.2 transformer runs in: Flux2Pipeline for a guidance-embedding one (dev),
    Flux2KleinPipeline for the Klein models."""
    import diffusers

    return diffusers.Flux2Pipeline if config.guidance_embeds else diffusers.Flux2KleinPipeline


def takes_negative_prompt(pipe: object) -> bool:
    """Whether a pipeline call takes negative prompt embeddings: Klein's (its CFG), FLUX.3's modular
    pipeline where its guider runs CFG (`requires_unconditional_embeds`)."""
    if hasattr(pipe, "requires_unconditional_embeds"):
        return bool(pipe.requires_unconditional_embeds)
    return "negative_prompt_embeds" in inspect.signature(pipe.__call__).parameters


def prompt_embeddings(pipe: object, txt_tokens: int) -> dict[str, torch.Tensor]:
    """Fixed random prompt embeddings of the transformer's text width for a FLUX.2 or FLUX.3 pipeline
    call, and negative prompt embeddings where the pipeline takes them (`takes_negative_prompt`)."""
    transformer = pipe.transformer
    gen = torch.Generator().manual_seed(1)
    shape = (1, txt_tokens, transformer.config.joint_attention_dim)
    embeds, negative = (
        torch.randn(shape, generator=gen).to(transformer.device, transformer.dtype) for _ in range(2)
    )
    prompts = {"prompt_embeds": embeds}
    if takes_negative_prompt(pipe):
        prompts["negative_prompt_embeds"] = negative
    return prompts


def pipeline_call(
    pipe: object,
    prompts: dict[str, torch.Tensor],
    height: int,
    width: int,
    steps: int,
    guidance_scale: float,
) -> Callable[[], torch.Tensor]:
    """One pipeline call with fixed prompt embeddings and a fixed seed, so every call makes the same
    image; returns the image tensor (output_type "pt"). A modular pipeline (FLUX.3's) takes no
    guidance scale, its guider holds it (`flux3.pipeline`), and returns the state value `output`
    names; a classic one returns an output whose `images` it is."""
    from diffusers.modular_pipelines import ModularPipeline

    settings = {
        **prompts,
        "height": height,
        "width": width,
        "num_inference_steps": steps,
        "output_type": "pt",
    }
    if isinstance(pipe, ModularPipeline):

        def call() -> torch.Tensor:
            return pipe(**settings, generator=torch.Generator().manual_seed(0), output="images")

    else:

        def call() -> torch.Tensor:
            generator = torch.Generator().manual_seed(0)
            return pipe(**settings, guidance_scale=guidance_scale, generator=generator).images

    return call


def computed_steps(steps: int) -> list[int]:
    """The cache's schedule: the first two steps and every other step after them computed (1), the
    rest served from the cache (0)."""
    return [1 if i < 2 or i % 2 == 1 else 0 for i in range(steps)]


def apply_cache(pipe: object, cache: str, steps: int) -> None:
    """Stack `cache` ("none", "cache-dit", "magcache") on the pipeline's transformer, its skipped steps
    fixed by `computed_steps` (MagCache: a threshold nothing reaches, one skip at most in a row)."""
    if cache == "cache-dit":
        import cache_dit

        config = cache_dit.DBCacheConfig(
            Fn_compute_blocks=1,
            Bn_compute_blocks=0,
            num_inference_steps=steps,
            steps_computation_mask=computed_steps(steps),
            steps_computation_policy="static",
        )
        cache_dit.enable_cache(pipe, cache_config=config)
    elif cache == "magcache":
        from diffusers import MagCacheConfig

        config = MagCacheConfig(
            threshold=1e9,
            max_skip_steps=1,
            retention_ratio=2 / steps,
            num_inference_steps=steps,
            mag_ratios=[1.0] * steps,
        )
        pipe.transformer.enable_cache(config)


def bench_config(
    name: str,
    pairs: int,
    height: int,
    width: int,
    steps: int,
    guidance_scale: float,
    txt_tokens: int,
    cache: str = "none",
) -> PipelineResult:
    device = torch.device("cuda", torch.cuda.current_device())
    family = diffusers_only(name)
    if family == "FLUX.1":
        transformer = flux1.random_transformer(name, device, torch.bfloat16)
        pipe = flux1.pipeline(transformer)
        prompts = flux1.prompt_embeddings(transformer, txt_tokens)
    else:
        if family == "FLUX.3":
            transformer = flux3.random_transformer(name, device, torch.bfloat16)
            pipe = flux3.pipeline(transformer, guidance_scale=guidance_scale)
        else:
            config = Flux2Config.preset(name)
            transformer = hosts.diffusers_host(config, device, torch.bfloat16)
            pipe = hosts.klein_pipeline(pipeline_class(config), transformer)
        prompts = prompt_embeddings(pipe, txt_tokens)
    apply_cache(pipe, cache, steps)
    call = pipeline_call(pipe, prompts, height, width, steps, guidance_scale)

    switch = functools.partial(hosts.use_fused, pipe)

    def run(fused: bool) -> torch.Tensor:
        switch(fused)
        return call()

    with torch.inference_mode():
        images = {mode: run(mode) for mode in (False, True)}  # warm-up; the fused one self-checks
        timing = Timing.of(time_synchronized(run, pairs, switch))
        fused_launches = kernel_breakdown(lambda: run(True)).launches["fused"]
    return PipelineResult(
        config=name,
        height=height,
        width=width,
        steps=steps,
        guidance_scale=guidance_scale,
        txt_tokens=txt_tokens,
        pairs=pairs,
        cache=cache,
        fused_launches=fused_launches,
        diffusers=importlib.metadata.version("diffusers"),
        timing=timing,
        diffusers_sha256=tensor_sha256(images[False]),
        fused_sha256=tensor_sha256(images[True]),
        images_equal=torch.equal(images[False], images[True]),
    )


def check(args: argparse.Namespace) -> None:
    """Refuse, before any work, values the run cannot use and a missing diffusers (BadValue, exit 2);
    --json is checked as it is parsed (`options.OutputFile`)."""
    require_at_least_one({"--pairs": args.pairs, "--steps": args.steps, "--text-tokens": args.txt_tokens})
    check_side("--height", args.height)
    check_side("--width", args.width)
    hosts.check_diffusers_host("the pipeline benchmark")
    flux3_configs = [name for name in args.configs if diffusers_only(name) == "FLUX.3"]
    if flux3_configs and (caches := [cache for cache in args.cache if cache != "none"]):
        # Neither knows FLUX.3's blocks yet: the run would fail at that config, after the others.
        raise BadValue(f"--cache {' '.join(caches)}: cache-dit and diffusers' caches do not run on FLUX.3")
    if flux3_configs and importlib.util.find_spec("transformers") is None:
        raise BadValue(
            f"{', '.join(flux3_configs)}: diffusers' FLUX.3 pipeline needs transformers, which is not "
            "installed (pip install transformers)"
        )
    if "cache-dit" in args.cache and importlib.util.find_spec("cache_dit") is None:
        raise BadValue("--cache cache-dit needs cache-dit, which is not installed (pip install cache-dit)")


def run(args: argparse.Namespace) -> int:
    """Time every config on the current CUDA GPU and print the table; 1 when the images differ."""
    results = []
    for name in args.configs:
        for cache in args.cache:
            results.append(
                bench_config(
                    name,
                    args.pairs,
                    args.height,
                    args.width,
                    args.steps,
                    args.guidance_scale,
                    args.txt_tokens,
                    cache,
                )
            )
            gc.collect()  # drop the previous pipeline before building the next
            torch.cuda.empty_cache()
    print(format_pipeline_table(results, torch.cuda.get_device_name(), torch.__version__))
    if args.json:
        write_json([asdict(r) for r in results], args.json)
    return 0 if all(r.images_equal for r in results) else 1
