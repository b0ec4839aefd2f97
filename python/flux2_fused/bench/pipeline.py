"""Whole-pipeline benchmark: diffusers' Flux2KleinPipeline call, alone vs with `enable(pipe)`.

    flux2-fused pipeline [--configs klein-4b] [--pairs N] [--steps N] [--height PX --width PX]
                         [--txt-tokens N] [--guidance-scale S] [--json FILE]
    (also python -m flux2_fused.bench.pipeline)

What a user of diffusers sees end to end: the denoise loop with classifier-free guidance (two
transformer calls a step, prompt and negative prompt embeddings), the scheduler, the VAE decode and
the image postprocessing, all of diffusers' code, with only the transformer's forward patched. Random
weights: the package's random transformer as diffusers' Flux2Transformer2DModel (`bench.hosts`),
diffusers' AutoencoderKLFlux2 at its default config, the default FlowMatchEulerDiscreteScheduler;
random prompt embeddings stand in for the text encoder, which is not part of the call's transformer
work and is not built.

One pipeline, switched between diffusers' forward and enable() call by call (interleaved as the step
benchmark's pairs), after a warm-up call of each (the fused one self-checks). Each call starts on an
idle GPU and is waited for, as a user's call ends with an image to use. The images (output_type "pt")
of the warm-up calls are compared with torch.equal.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.metadata
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from ..errors import BadValue
from ..models.flux2 import Flux2Config
from . import hosts
from .denoise import _check_side
from .report import PipelineResult, Timing, check_output, format_pipeline_table, write_json
from .step import tensor_sha256, time_synchronized

PRESETS = ("klein-4b", "klein-9b")  # the Klein pipeline's transformers (no guidance embedder)


def klein_call(
    pipe: object,
    config: Flux2Config,
    height: int,
    width: int,
    steps: int,
    guidance_scale: float,
    txt_tokens: int,
) -> Callable[[], torch.Tensor]:
    """One Flux2KleinPipeline call with fixed random prompt and negative prompt embeddings and a fixed
    seed, so every call makes the same image; returns the image tensor (output_type "pt")."""
    weight = next(pipe.transformer.parameters())
    gen = torch.Generator().manual_seed(1)
    shape = (1, txt_tokens, config.joint_attention_dim)
    embeds, negative = (torch.randn(shape, generator=gen).to(weight.device, weight.dtype) for _ in range(2))

    def call() -> torch.Tensor:
        return pipe(
            prompt_embeds=embeds,
            negative_prompt_embeds=negative,
            height=height,
            width=width,
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
        ).images

    return call


def bench_config(
    name: str, pairs: int, height: int, width: int, steps: int, guidance_scale: float, txt_tokens: int
) -> PipelineResult:
    from diffusers import Flux2KleinPipeline

    config = Flux2Config.preset(name)
    device = torch.device("cuda", torch.cuda.current_device())
    transformer = hosts.diffusers_host(config, device, torch.bfloat16)
    pipe = hosts.klein_pipeline(Flux2KleinPipeline, transformer)
    call = klein_call(pipe, config, height, width, steps, guidance_scale, txt_tokens)

    switch = functools.partial(hosts.use_fused, pipe)

    def run(fused: bool) -> torch.Tensor:
        switch(fused)
        return call()

    with torch.inference_mode():
        images = {mode: run(mode) for mode in (False, True)}  # warm-up; the fused one self-checks
        timing = Timing.of(time_synchronized(run, pairs, switch))
    return PipelineResult(
        config=name,
        height=height,
        width=width,
        steps=steps,
        guidance_scale=guidance_scale,
        txt_tokens=txt_tokens,
        pairs=pairs,
        diffusers=importlib.metadata.version("diffusers"),
        timing=timing,
        diffusers_sha256=tensor_sha256(images[False]),
        fused_sha256=tensor_sha256(images[True]),
        images_equal=torch.equal(images[False], images[True]),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The pipeline benchmark's options (the `flux2-fused pipeline` subcommand's)."""
    parser.add_argument(
        "--configs", nargs="*", default=["klein-4b"], choices=PRESETS, help="default: klein-4b"
    )
    parser.add_argument("--pairs", type=int, default=3, metavar="N", help="timed calls a mode (default 3)")
    parser.add_argument("--steps", type=int, default=8, metavar="N", help="denoise steps a call (default 8)")
    parser.add_argument("--height", type=int, default=1024, metavar="PX", help="default 1024")
    parser.add_argument("--width", type=int, default=1024, metavar="PX", help="default 1024")
    parser.add_argument(
        "--txt-tokens", type=int, default=512, metavar="N", help="prompt embedding tokens (default 512)"
    )
    parser.add_argument(
        "--guidance-scale",
        type=float,
        default=4.0,
        metavar="S",
        help="CFG scale; above 1 each step runs the prompt and the negative prompt (default 4.0)",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the results to FILE")


def check(args: argparse.Namespace) -> None:
    """Refuse, before any work, values the run cannot use and a missing diffusers (BadValue, exit 2)."""
    check_output("--json", args.json)
    for option, value in (("pairs", args.pairs), ("steps", args.steps), ("txt-tokens", args.txt_tokens)):
        if value < 1:
            raise BadValue(f"--{option} must be at least 1, got {value}")
    _check_side("height", args.height)
    _check_side("width", args.width)
    hosts.check_diffusers_host("the pipeline benchmark")


def run(args: argparse.Namespace) -> int:
    """Time every config on the current CUDA GPU and print the table; 1 when the images differ."""
    results = []
    for name in args.configs:
        results.append(
            bench_config(
                name, args.pairs, args.height, args.width, args.steps, args.guidance_scale, args.txt_tokens
            )
        )
        gc.collect()  # drop the previous pipeline before building the next
        torch.cuda.empty_cache()
    print(format_pipeline_table(results, torch.cuda.get_device_name(), torch.__version__))
    if args.json:
        write_json([asdict(r) for r in results], args.json)
    return 0 if all(r.images_equal for r in results) else 1


if __name__ == "__main__":
    from ..cli import main

    sys.exit(main(["pipeline", *sys.argv[1:]]))
