"""What the `flux2-fused` commands do, once `flux2_fused.cli` has parsed their arguments.

`bench` plans, runs, prints and writes the denoise benchmark; `step`, `pipeline` and `kernel` run
their benchmarks on a CUDA GPU; `verify` runs every op's bit-exactness self-check for the configurations
the op lists (`ops.OPS`), and without a GPU says where each op's module would come from; `build`
compiles every op's kernel without a GPU. They sit here, outside
`bench`, so that the benchmarks and the plot never import each other and the command line only
parses (and imports no torch: cli imports this module once the arguments parse).

Each command checks all its arguments and output paths first (the paths as they are parsed,
`options.OutputFile`), then the machine (a CUDA GPU, memory, the CPU's speed, optional packages),
then works: a wrong option is reported as such on any machine.
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from .bench import denoise, kernel, parallel, pipeline, plot, step
from .bench.options import check_output, folder_problem
from .bench.results.bench import format_summary
from .bench.results.parallel import ParallelResult, format_parallel_table
from .bench.results.tables import markdown_table, write_json
from .bench.results.verify import VerifyRow, format_verify
from .errors import BadValue, CommandError, NeedsCuda
from .models.weights import WeightsError
from .ops import OPS, jit

# The errors a command reports as a plain line; anything else is called unexpected.
EXPECTED_ERRORS = (CommandError, WeightsError, jit.BuildError, OSError)


def exit_code(exc: BaseException) -> int:
    """The exit status of a failed command: 2 when the arguments ask for what cannot be done (a
    --weights folder that is not a usable FLUX.2 transformer among them), 1 for a failure while running."""
    return 2 if isinstance(exc, WeightsError) else getattr(exc, "exit_code", 1)


def one_line(exc: BaseException) -> str:
    """The error as one line; the rest of a multi-line message (a compiler log) is left to --debug."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    more = f" (+{len(lines) - 1} more lines; --debug shows them)" if len(lines) > 1 else ""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return f"out of GPU memory: {lines[0]}{more}; try a smaller --config, --height/--width or --batch"
    if isinstance(exc, EXPECTED_ERRORS):
        return lines[0] + more
    return f"{type(exc).__name__}: {lines[0]}{more} (unexpected; --debug shows the traceback)"


def require_cuda(what: str) -> torch.device:
    """The current CUDA device, or NeedsCuda naming the command that needs one."""
    if not torch.cuda.is_available():
        raise NeedsCuda(f"{what} needs a CUDA GPU and none is available")
    return torch.device("cuda", torch.cuda.current_device())


# --------------------------------------------------------------------------- benchmarks


def bench(args: argparse.Namespace) -> int:
    """`flux2-fused bench`, on one device or (`--parallel`) under a multi-GPU plan."""
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
        return parallel_command(request, args)
    return bench_command(request, args.json, args.plot, args.allow_slow)


def bench_command(
    request: denoise.BenchRequest,
    json_path: Path | None = None,
    plot_path: Path | None = None,
    allow_slow: bool = False,
) -> int:
    """`flux2-fused bench`: the arguments (output paths, then the plan), the machine (matplotlib for
    --plot, the CPU's memory and speed), then run, print the summary and how to read it where it could
    mislead (`denoise.reading_notes`), write the files; 1 when not bit-exact."""
    check_output("--json", json_path)
    check_output("--plot", plot_path, suffix=".png")
    p = denoise.check_cpu_run(denoise.plan(request), allow_slow)
    if plot_path is not None:
        plot.require_matplotlib()
    for note in p.notes:
        print(f"flux2-fused: {note}", file=sys.stderr)
    report = denoise.run(p)
    print(format_summary(report))
    for note in denoise.reading_notes(report):
        print(f"note: {note}")
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
    check: Callable[[argparse.Namespace], None],
    run: Callable[[argparse.Namespace], int],
    args: argparse.Namespace,
) -> int:
    """`flux2-fused step`, `pipeline` and `kernel`: refuse bad arguments (`check`, which raises
    BadValue), then refuse without a CUDA GPU, else run the benchmark. Arguments first, so a wrong
    option is reported as such on any machine."""
    check(args)
    require_cuda(what)
    return run(args)


# --------------------------------------------------------------------------- verify


def verify_kernels() -> list[VerifyRow]:
    """The kernels' live bit-exactness self-checks on this GPU, every op in every configuration, with
    where each op's module came from (bundled in the wheel, the cache, built now)."""
    device = require_cuda("verify")
    rows = []
    arch = jit.device_arch(device)
    for op in OPS:
        try:  # load (or build) once up front: an unavailable module is one row, not one a config
            jit.module_for(op.spec, device)
        except jit.BuildError as exc:
            rows.append(VerifyRow(op.name, "-", False, f"module unavailable: {exc}", 0.0, "unavailable"))
            continue
        origin = f"{jit.module_source(op.spec, arch)[0]}, sm {arch}"
        for config in op.verify_configs:
            if op.unbuilt(device, config) is not None:
                continue  # not built for this GPU: the guards decline it without a check
            start = time.perf_counter()
            try:
                with torch.inference_mode():
                    passed, detail = op.self_check(device, config)
            except Exception as exc:  # a crash is a failed check of this row; the others still run
                passed, detail = False, f"{type(exc).__name__}: {exc}"
            rows.append(VerifyRow(op.name, str(config), passed, detail, time.perf_counter() - start, origin))
    return rows


def _bundled(op_name: str, spec: jit.KernelSpec) -> str | None:
    """What the installed bundle holds for an op, from its manifest: the library and the architectures
    it runs on (those `jit.bundled_library` takes it for: same sources, file present); None for none."""
    entry = jit._bundle_manifest(jit.BUNDLE_DIR).get("modules", {}).get(op_name)
    if not isinstance(entry, dict) or not isinstance(entry.get("archs"), list):
        return None
    archs = [str(arch) for arch in entry["archs"] if jit.bundled_library(spec, str(arch)) is not None]
    if not archs:
        return None
    ptx = f", PTX {entry['ptx']} for newer GPUs" if entry.get("ptx") else ""
    return f"bundled ({entry['library']}): sm {' '.join(archs)}{ptx}"


def planned_sources() -> dict[str, str]:
    """Where each op's module would come from on a GPU, said without one: the wheel's bundle (its
    architectures, from the manifest), else a JIT build with the local nvcc, else none and why; the
    loader's order (`jit.module_source`), for no GPU in particular. So a machine without a GPU still
    shows whether the wheel just built and installed is the one in use."""
    loader = jit.loader_reason()
    if loader is not None:
        return {op.name: f"none: {loader}" for op in OPS}
    toolchain = jit.toolchain_reason()
    built = (
        None if toolchain else f"a JIT build with nvcc at {jit.find_nvcc()} (cached in {jit.cache_root()})"
    )
    sources = {}
    for op in OPS:
        ways = [way for way in (_bundled(op.name, op.spec), built) if way is not None]
        sources[op.name] = ", else ".join(ways) if ways else f"none: no bundled module, and {toolchain}"
    return sources


def verify_command() -> int:
    """`flux2-fused verify`: print the self-check table; 1 when any configuration fails. Without a GPU,
    where each op's module would come from, then NeedsCuda (exit status 2: nothing to check here)."""
    if not torch.cuda.is_available():
        table = markdown_table(["op", "module on a CUDA GPU"], list(planned_sources().items()))
        print("flux2-fused verify: no CUDA GPU here, so no self-check; each op's module would come from:")
        print(table)
        require_cuda("verify")  # raises NeedsCuda: exit status 2, nothing to check here
    rows = verify_kernels()
    print(format_verify(rows, torch.cuda.get_device_name(), torch.__version__))
    return 0 if all(r.passed for r in rows) else 1


# --------------------------------------------------------------------------- build


def parse_arch(text: str) -> str:
    """A --arch value in tvm-ffi's 'M.m[a]' form; BadValue when unrecognizable or too old, so the
    user hears it before a build that nvcc would fail many lines later."""
    try:
        arch = jit.normalize_arch(text)
    except ValueError as exc:
        raise BadValue(f"argument --arch: {exc}") from exc
    reason = jit.arch_reason(arch)
    if reason is not None:
        raise BadValue(f"argument --arch: {reason}")
    return arch


def default_archs() -> list[str]:
    """The present GPU's architecture, else Hopper and Blackwell (9.0, 10.0)."""
    if torch.cuda.is_available():
        return [jit.device_arch(torch.cuda.current_device())]
    return ["9.0", "10.0"]


def build_command(arch_texts: Sequence[str] | None = None) -> int:
    """`flux2-fused build`: compile (or find cached) every op's library for each architecture given
    (checked, all of them, before the first build), else this GPU's or Hopper's and Blackwell's, and
    print its path.

    One library per op and architecture, not one fat binary, because that is what the runtime loads
    (`jit.load_module(spec, arch)`): this fills exactly the cache entries a later run looks up.
    """
    archs = [parse_arch(text) for text in arch_texts] if arch_texts else default_archs()
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


def bundle_command(folder: Path, arch_texts: Sequence[str] | None = None) -> int:
    """`flux2-fused build --bundle DIR`: the wheel's prebuilt modules (`ops.bundle`), every op, into
    DIR; --arch replaces the bundle's architectures (the PTX stays that of the newest)."""
    from .ops import bundle

    archs = [parse_arch(text) for text in arch_texts] if arch_texts else list(bundle.ARCHS)
    if folder.exists() and not folder.is_dir():
        raise BadValue(f"--bundle {folder} is a file; give a folder")
    problem = folder_problem(folder.parent)
    if problem is not None:
        raise BadValue(f"--bundle {folder}: {problem}")
    start = time.perf_counter()
    manifest = bundle.build_bundle(folder, archs=archs, ptx=max(archs, key=jit.arch_tuple))
    for name, entry in manifest["modules"].items():
        print(f"{name}: {folder / entry['library']} (sm {' '.join(entry['archs'])}, PTX {entry['ptx']})")
    seconds = time.perf_counter() - start
    print(f"flux2-fused: bundled {len(manifest['modules'])} modules in {seconds:.0f} s", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- dispatch

# What `flux2-fused NAME` runs, by NAME, given the parsed arguments.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "bench": bench,
    "step": functools.partial(gpu_benchmark_command, "the step benchmark", step.check, step.run),
    "pipeline": functools.partial(
        gpu_benchmark_command, "the pipeline benchmark", pipeline.check, pipeline.run
    ),
    "kernel": functools.partial(gpu_benchmark_command, "the kernel benchmark", kernel.check, kernel.run),
    "verify": lambda _args: verify_command(),
    "build": lambda args: bundle_command(args.bundle, args.arch) if args.bundle else build_command(args.arch),
}
