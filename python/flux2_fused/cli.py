"""The `flux2-fused` command (also `python -m flux2_fused`): argument parsing and dispatch only.

    flux2-fused bench [--config NAME | --weights PATH] [--height PX --width PX] [--steps N] [--batch N]
                      [--text-tokens N] [--seed N] [--dtype bf16|fp16|fp32] [--json FILE] [--plot FILE.png]
    flux2-fused bench --parallel ulysses=2|ring=2|tp=2 [--config NAME] [--steps N] [--json FILE] ...
                                      one step under diffusers' multi-GPU plans, alone vs enable()
                                      (flux2_fused.bench.parallel; starts torchrun)
    flux2-fused step [--configs NAME ...] [--steps N] [--compile] [--host package|diffusers] [--lora R]
                     [--offload none|model|group] [--json FILE] ...
                                      one denoise step, eager vs fused (flux2_fused.bench.step)
    flux2-fused pipeline [--configs NAME ...] [--pairs N] [--steps N] [--json FILE] ...
                                      a diffusers Flux2KleinPipeline call, alone vs enable(pipe)
                                      (flux2_fused.bench.pipeline)
    flux2-fused kernel [--shapes DxT ...] [--json FILE] ...
                                      one fused site, eager vs fused (flux2_fused.bench.kernel)
    flux2-fused verify                the kernel's bit-exactness self-check on this GPU
    flux2-fused build [--arch 9.0 ...]  compile the kernels (no GPU needed) and print the libraries

The work is in `flux2_fused.commands`; the benchmarks' options are declared by their modules.
Every failure is one line on stderr, `flux2-fused: error: ...` (`--debug` re-raises it with its
traceback instead), and the exit status says whose it is:
    0  success
    1  a failure while running: a kernel build, out of memory, fused and eager results that differ,
       a failed self-check, matplotlib missing for --plot, anything unexpected
    2  bad arguments, found before any work: argparse's usage errors, values the run cannot use, a
       --weights folder that is not a usable FLUX.2 transformer, an output file that cannot be
       written, a missing CUDA GPU, a model too large for the CPU's memory
    130  interrupted
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from . import commands
from .bench import denoise, kernel, pipeline, step

PROG = "flux2-fused"


def _arch(text: str) -> str:
    """--arch values in tvm-ffi's form, rejected at parse time (a usage error) when unrecognizable."""
    try:
        return commands.parse_arch(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _bench(args: argparse.Namespace) -> int:
    request = denoise.BenchRequest(
        config=args.config,
        weights=args.weights,
        height=args.height,
        width=args.width,
        steps=args.steps,
        batch=args.batch,
        text_tokens=args.text_tokens,
        seed=args.seed,
        dtype=args.dtype,
    )
    if args.parallel is not None:
        return commands.parallel_command(request, args)
    return commands.bench_command(request, args.json, args.plot)


def _step(args: argparse.Namespace) -> int:
    return commands.gpu_benchmark_command("the step benchmark", step.run, args, step.check)


def _pipeline(args: argparse.Namespace) -> int:
    return commands.gpu_benchmark_command("the pipeline benchmark", pipeline.run, args, pipeline.check)


def _kernel(args: argparse.Namespace) -> int:
    return commands.gpu_benchmark_command("the kernel benchmark", kernel.run, args)


def _verify(_args: argparse.Namespace) -> int:
    return commands.verify_command()


def _build(args: argparse.Namespace) -> int:
    return commands.build_command(args.arch or commands.default_archs())


Handler = Callable[[argparse.Namespace], int]


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and its subcommand parsers by name."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Lossless fused kernels for FLUX.2: benchmark, verify, build."
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show tracebacks instead of one-line errors",
    )
    # SUPPRESS: a subcommand's --debug must not reset one given before the subcommand.
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show tracebacks instead of one-line errors",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{bench,step,pipeline,kernel,verify,build}"
    )
    subparsers: dict[str, argparse.ArgumentParser] = {}

    def add(name: str, handler: Handler, help_text: str, **kwargs: object) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, parents=[debug], **kwargs)
        p.set_defaults(handler=handler)
        subparsers[name] = p
        return p

    bench = add(
        "bench",
        _bench,
        "denoise loop, eager vs fused on one model: step time, launches, kernel time by site, bit-exactness",
        epilog="The --json fields are documented in flux2_fused.bench.report.BenchReport.",
    )
    source = bench.add_mutually_exclusive_group()
    source.add_argument(
        "--config",
        choices=denoise.PRESETS,
        help="preset with random weights (default: dev on a GPU with room for it, klein-4b on a smaller "
        "GPU, tiny on the CPU)",
    )
    source.add_argument(
        "--weights", type=Path, metavar="PATH", help="diffusers-format folder (config.json decides the model)"
    )
    sides = f"pixels, a multiple of 16 (default {denoise.GPU_SIDE} on a GPU, {denoise.CPU_SIDE} on the CPU)"
    bench.add_argument("--height", type=int, metavar="PX", help=sides)
    bench.add_argument("--width", type=int, metavar="PX", help=sides)
    for option, default, what in (
        ("--steps", denoise.DEFAULT_STEPS, "timed denoise steps a mode"),
        ("--batch", 1, "batch size"),
        ("--text-tokens", denoise.DEFAULT_TEXT_TOKENS, "text tokens a sample"),
        ("--seed", 0, "seed of the weights, latents and text embeddings"),
    ):
        bench.add_argument(option, type=int, default=default, metavar="N", help=f"{what} (default {default})")
    bench.add_argument("--dtype", choices=list(denoise.DTYPES), help="default bf16 on a GPU, fp32 on the CPU")
    bench.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    bench.add_argument(
        "--plot", type=Path, metavar="FILE.png", help="draw step and kernel times (needs matplotlib)"
    )
    bench.add_argument(
        "--parallel",
        metavar="PLAN",
        help="one step under diffusers' parallelism on several GPUs, diffusers alone vs enable(), e.g. "
        "ulysses=2, ring=2, ulysses=2,ring=2 or tp=2 (starts torchrun, or runs inside it; --steps timed "
        "pairs; flux2_fused.bench.parallel)",
    )

    step.add_arguments(
        add(
            "step",
            _step,
            "one denoise step at 1024x1024, eager vs fused, synchronized and pipelined (CUDA GPU)",
            epilog="The --json fields are documented in flux2_fused.bench.report.StepResult.",
        )
    )
    pipeline.add_arguments(
        add(
            "pipeline",
            _pipeline,
            "a diffusers Flux2KleinPipeline call (CFG, VAE decode), alone vs enable(pipe), images compared "
            "(CUDA GPU)",
            epilog="The --json fields are documented in flux2_fused.bench.report.PipelineResult.",
        )
    )
    kernel.add_arguments(
        add(
            "kernel",
            _kernel,
            "one fused site [B, T, D], eager vs fused kernel, plain and in CUDA graphs (CUDA GPU)",
            epilog="The --json fields are documented in flux2_fused.bench.report.KernelReport.",
        )
    )
    add("verify", _verify, "bit-exactness self-check of the fused kernel on this GPU")
    build = add("build", _build, "compile the kernels (nvcc, no GPU needed) and print the libraries")
    build.add_argument(
        "--arch",
        nargs="+",
        action="extend",
        type=_arch,
        help="CUDA architectures, 8.0 or newer, e.g. --arch 9.0 10.0 (default: this GPU's, else 9.0 10.0)",
    )
    return parser, subparsers


def _one_line(exc: BaseException) -> str:
    """The error as one line; the rest of a multi-line message (a compiler log) is left to --debug."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    more = f" (+{len(lines) - 1} more lines; --debug shows them)" if len(lines) > 1 else ""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return f"out of GPU memory: {lines[0]}{more}; try a smaller --config, --height/--width or --batch"
    if isinstance(exc, commands.EXPECTED_ERRORS):
        return lines[0] + more
    return f"{type(exc).__name__}: {lines[0]}{more} (unexpected; --debug shows the traceback)"


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (the console script passes it to sys.exit)."""
    parser, subparsers = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what `bench --parallel` reruns under torchrun
    if extra:  # reported by the subcommand's parser, so its usage line is the one shown
        subparsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return commands.exit_code(exc)
