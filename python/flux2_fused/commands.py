"""What the `flux2-fused` commands do, once `flux2_fused.cli` has parsed their arguments.

`bench` plans, runs, prints and writes the denoise benchmark; `step`, `pipeline` and `kernel` run
their benchmarks on a CUDA GPU; `verify` runs every op's bit-exactness self-check for the configurations
the op lists (`ops.OPS`); `build` compiles every op's kernel without a GPU. They sit here, outside
`bench`, so that the benchmarks and the plot never import each other and the command line only
parses.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from .bench import denoise, parallel, plot
from .bench.report import (
    ParallelResult,
    VerifyRow,
    check_output,
    format_parallel_table,
    format_summary,
    format_verify,
    write_json,
)
from .errors import BadValue, CommandError, NeedsCuda
from .models.weights import WeightsError
from .ops import OPS, jit

MIN_ARCH = 8  # the kernels use sm_80 instructions (bf16 pair math): major 8 or newer
# The errors a command reports as a plain line; anything else is called unexpected.
EXPECTED_ERRORS = (CommandError, WeightsError, jit.BuildError, OSError)


def exit_code(exc: BaseException) -> int:
    """The exit status of a failed command: 2 when the arguments ask for what cannot be done (a
    --weights folder that is not a usable FLUX.2 transformer among them), 1 for a failure while running."""
    return 2 if isinstance(exc, WeightsError) else getattr(exc, "exit_code", 1)


def require_cuda(what: str) -> torch.device:
    """The current CUDA device, or NeedsCuda naming the command that needs one."""
    if not torch.cuda.is_available():
        raise NeedsCuda(f"{what} needs a CUDA GPU and none is available")
    return torch.device("cuda", torch.cuda.current_device())


# --------------------------------------------------------------------------- benchmarks


def bench_command(
    request: denoise.BenchRequest, json_path: Path | None = None, plot_path: Path | None = None
) -> int:
    """`flux2-fused bench`: plan, run, print the summary, write the files; 1 when not bit-exact."""
    check_output("--json", json_path)
    check_output("--plot", plot_path, suffix=".png")
    p = denoise.plan(request)
    if plot_path is not None:
        plot.require_matplotlib()
    for note in p.notes:
        print(f"flux2-fused: {note}", file=sys.stderr)
    report = denoise.run(p)
    print(format_summary(report))
    if json_path is not None:
        write_json(asdict(report), json_path)
        print(f"flux2-fused: wrote {json_path.resolve()}", file=sys.stderr)
    if plot_path is not None:
        plot.save_plot(report, plot_path)
        print(f"flux2-fused: wrote {plot_path.resolve()}", file=sys.stderr)
    if not report.bit_exact:
        print(
            "flux2-fused: error: the fused and eager final latents differ (see the SHA-256s)", file=sys.stderr
        )
        return 1
    return 0


def parallel_command(request: denoise.BenchRequest, args: argparse.Namespace) -> int:
    """`flux2-fused bench --parallel PLAN`: check everything, then either start torchrun with this
    command line (one process a GPU) or, inside torchrun, run this process's rank; rank 0 prints the
    table and writes the JSON. 1 when the fused output differs from diffusers' under the plan."""
    plan = parallel.parse_plan(args.parallel)
    for option, value in (("--weights", args.weights), ("--plot", args.plot)):
        if value is not None:
            raise BadValue(
                f"--parallel does not take {option} (it times random weights of a --config preset)"
            )
    check_output("--json", args.json)
    if parallel.under_torchrun():
        parallel.use_local_device()
    p = denoise.plan(request)
    if p.device.type != "cuda":
        raise NeedsCuda(f"--parallel {plan.label} needs {plan.world} CUDA GPUs and none is available")
    run = parallel.ParallelRequest(
        config=denoise.preset_name(p.config),
        img_tokens=p.image_tokens,
        txt_tokens=p.text_tokens,
        batch=p.batch,
        steps=p.steps,
        seed=p.seed,
        dtype=p.dtype,
    )
    if not parallel.under_torchrun():
        gpus = torch.cuda.device_count()
        if gpus < plan.world:
            raise NeedsCuda(f"--parallel {plan.label} needs {plan.world} CUDA GPUs, this machine has {gpus}")
        return subprocess.call(parallel.torchrun_command(plan.world, args.argv))

    def report(result: ParallelResult) -> None:
        print(format_parallel_table(result, torch.__version__))
        if args.json is not None:
            write_json(asdict(result), args.json)
            print(f"flux2-fused: wrote {args.json.resolve()}", file=sys.stderr)
        if not result.bit_exact:
            print(
                "flux2-fused: error: the fused output differs from diffusers' under the plan", file=sys.stderr
            )

    return parallel.run_job(run, plan, report)


def gpu_benchmark_command(
    what: str,
    run: Callable[[argparse.Namespace], int],
    args: argparse.Namespace,
    check: Callable[[argparse.Namespace], None] | None = None,
) -> int:
    """`flux2-fused step`, `pipeline` and `kernel`: refuse bad arguments (`check`, which raises
    BadValue), then refuse without a CUDA GPU, else run the benchmark. Arguments first, so a wrong
    option is reported as such on any machine."""
    if check is not None:
        check(args)
    require_cuda(what)
    return run(args)


# --------------------------------------------------------------------------- verify


def verify_kernels() -> list[VerifyRow]:
    """The kernels' live bit-exactness self-checks on this GPU, every op in every configuration."""
    device = require_cuda("verify")
    rows = []
    for op in OPS:
        jit.module_for(op.spec, device)  # build once up front: a failed build is one error, not 12
        for config in op.verify_configs:
            start = time.perf_counter()
            try:
                with torch.inference_mode():
                    passed, detail = op.self_check(device, config)
            except Exception as exc:  # a crash is a failed check of this row; the others still run
                passed, detail = False, f"{type(exc).__name__}: {exc}"
            rows.append(VerifyRow(op.name, str(config), passed, detail, time.perf_counter() - start))
    return rows


def verify_command() -> int:
    """`flux2-fused verify`: print the self-check table; 1 when any configuration fails."""
    rows = verify_kernels()
    print(format_verify(rows, torch.cuda.get_device_name(), torch.__version__))
    return 0 if all(r.passed for r in rows) else 1


# --------------------------------------------------------------------------- build


def parse_arch(text: str) -> str:
    """A --arch value in tvm-ffi's 'M.m[a]' form; ValueError when unrecognizable or too old, so the
    user hears it before a build that nvcc would fail many lines later."""
    arch = jit.normalize_arch(text)
    if int(arch.split(".")[0]) < MIN_ARCH:
        raise ValueError(
            f"sm {arch} is not supported: the kernels need sm_{MIN_ARCH}0 ({MIN_ARCH}.0) or newer"
        )
    return arch


def default_archs() -> list[str]:
    """The present GPU's architecture, else Hopper and Blackwell (9.0, 10.0)."""
    if torch.cuda.is_available():
        return [jit.device_arch(torch.cuda.current_device())]
    return ["9.0", "10.0"]


def build_command(archs: Sequence[str]) -> int:
    """`flux2-fused build`: compile (or find cached) every op's library for each architecture and
    print its path.

    One library per op and architecture, not one fat binary, because that is what the runtime loads
    (`jit.load_module(spec, arch)`): this fills exactly the cache entries a later run looks up.
    """
    for arch in archs:
        for op in OPS:
            cached = jit.is_cached(op.spec, [arch])
            if not cached:
                print(f"flux2-fused: building the {op.name} kernel for sm {arch}", file=sys.stderr)
            start = time.perf_counter()
            lib = jit.build(op.spec, [arch])
            how = "cached" if cached else f"built in {time.perf_counter() - start:.1f} s"
            print(f"flux2-fused: {op.name} for sm {arch}: {how}", file=sys.stderr)
            print(f"{arch} {op.name}: {lib}")
    return 0
