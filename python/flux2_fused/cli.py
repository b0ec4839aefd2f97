"""The `flux2-fused` command (also `python -m flux2_fused`): argument parsing and dispatch only.

    flux2-fused bench [--config NAME | --weights PATH] [--height PX --width PX] [--steps N] [--batch N]
                      [--text-tokens N] [--seed N] [--dtype bf16|fp16|fp32] [--json FILE] [--plot FILE.png]
                      [--allow-slow]
    flux2-fused bench --parallel ulysses=2|ring=2|tp=2 [--config NAME] [--steps N] [--json FILE] ...
                                      one step under diffusers' multi-GPU plans, alone vs enable()
                                      (flux2_fused.bench.parallel; starts torchrun)
    flux2-fused step [--config NAME ...] [--steps N] [--compile] [--host package|diffusers] [--lora R]
                     [--offload none|model|group] [--json FILE] ...
                                      one denoise step, eager vs fused (flux2_fused.bench.step)
    flux2-fused pipeline [--config NAME ...] [--pairs N] [--steps N] [--json FILE] ...
                                      a diffusers FLUX pipeline call (Flux2KleinPipeline, Flux2Pipeline,
                                      FluxPipeline, FLUX.3's modular pipelines), alone vs enable(pipe)
                                      (flux2_fused.bench.pipeline)
    flux2-fused kernel [--op OP] [--shapes AxT ...] [--json FILE] ...
                                      one fused site, eager vs fused (flux2_fused.bench.kernel)
    flux2-fused verify                every op's bit-exactness self-check on this GPU, and where each
                                      op's module comes from (without a GPU: only the latter, exit 2)
    flux2-fused build [--arch 9.0 ...]  compile the kernels (no GPU needed) and print the libraries

`--config` and `--text-tokens` are spelt alike on every command; `--configs` and `--txt-tokens`, the
spelling `step` and `pipeline` had, are accepted too.

This module imports no torch, so `--help` and usage errors answer at once: the benchmarks' options
are declared in `flux2_fused.bench.options` (torch-free too), and the work, in
`flux2_fused.commands`, is imported only once the arguments parse.

Every command checks all its arguments and output paths (those as they are parsed:
`options.OutputFile`) before it looks at the machine (a CUDA GPU, memory, the CPU's speed, optional
packages), so a wrong option is reported as such anywhere. Every
failure is one line on stderr, `flux2-fused: error: ...` (`--debug` prints the traceback instead,
with the same exit status), and the exit status says whose it is:
    0  success
    1  a failure while running: a kernel build, out of memory, fused and eager results that differ,
       a failed self-check, matplotlib missing for --plot, anything unexpected
    2  bad arguments, found before any work: argparse's usage errors, values the run cannot use, a
       --weights folder that is not a usable FLUX.2 transformer, an output file that cannot be
       written, a missing CUDA GPU, a model too large for the CPU's memory, a CPU run estimated
       over an hour without --allow-slow
    130  interrupted
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from .bench import options
from .bench.options import Parser

PROG = options.PROG


def build_parser() -> tuple[Parser, dict[str, Parser]]:
    """The top-level parser and its subcommand parsers by name."""
    parser = Parser(
        prog=PROG,
        description="Bit-exact fused CUDA kernels for diffusion transformers (FLUX.3, FLUX.2, FLUX.1, "
        "Qwen-Image, Z-Image): benchmark, verify, build.",
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
    subparsers: dict[str, Parser] = {}

    def add(name: str, help_text: str, epilog: str | None = None) -> Parser:
        subparsers[name] = sub.add_parser(
            name, help=help_text, description=help_text, parents=[debug], epilog=epilog
        )
        return subparsers[name]

    def fields(report: str) -> str:
        return f"The --json fields are documented in flux2_fused.bench.results.{report}."

    options.add_bench_arguments(
        add(
            "bench",
            "denoise loop, eager vs fused on one model: step time, launches, kernel time by site, "
            "bit-exactness",
            fields("bench.BenchReport"),
        )
    )
    options.add_step_arguments(
        add(
            "step",
            "one denoise step (1024x1024, or each of --sizes and --batch), eager vs fused, synchronized "
            "and pipelined (CUDA GPU)",
            fields("step.StepResult"),
        )
    )
    options.add_pipeline_arguments(
        add(
            "pipeline",
            "a diffusers pipeline call, alone vs enable(pipe), images compared: Flux2KleinPipeline "
            "(klein-4b, klein-9b; CFG), Flux2Pipeline (dev), FluxPipeline (flux1-dev, flux1-schnell), "
            "FLUX.3's modular pipelines Flux3ModularPipeline (flux3-klein; CFG) and "
            "Flux3DistilledModularPipeline (flux3-klein-flow); VAE decode included (CUDA GPU)",
            fields("pipeline.PipelineResult"),
        )
    )
    options.add_kernel_arguments(
        add(
            "kernel",
            "one fused site [B, T, D], eager vs fused kernel, plain and in CUDA graphs (CUDA GPU)",
            fields("kernel.KernelReport"),
        )
    )
    add(
        "verify",
        f"every fused op's bit-exactness self-check on this GPU ({', '.join(options.KERNEL_OPS)}), with "
        "where each op's module came from (bundled in the wheel, the cache, built now); without a GPU, "
        "where each would come from, then exit status 2",
    )
    build = add("build", "compile every op's kernel (nvcc, no GPU needed) and print the libraries")
    build.add_argument(
        "--arch",
        nargs="+",
        action="extend",
        help="CUDA architectures, 8.0 or newer, e.g. --arch 9.0 10.0 (default: this GPU's, else 9.0 10.0)",
    )
    build.add_argument(
        "--bundle",
        type=Path,
        metavar="DIR",
        help="instead: one module per op for the wheel's architectures (8.0 8.6 8.9 9.0 10.0 12.0 and "
        "12.0 PTX, the CUDA runtime linked statically) and their manifest, into DIR",
    )
    return parser, subparsers


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (the console script passes it to sys.exit)."""
    args = build_parser()[0].parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what `bench --parallel` reruns under torchrun
    try:
        from . import commands  # torch and the benchmarks: seconds, so only once the arguments parse

        return commands.COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        from . import commands  # imported above: a command raised

        if args.debug:
            traceback.print_exc()
        else:
            print(f"{PROG}: error: {commands.one_line(exc)}", file=sys.stderr)
        return commands.exit_code(exc)
