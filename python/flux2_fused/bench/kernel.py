"""Kernel benchmark: one FLUX.2 site (gated residual + LayerNorm + adaLN), eager vs fused.

    flux2-fused kernel [--shapes 6144x4608 3072x4096 ...] [--no-compile] [--json FILE]
    (also python -m flux2_fused.bench.kernel)

For each (D, T): the eager chain, the eager chain replayed from a CUDA graph, torch.compile of the
chain (not bit-exact; for reference), and the fused kernel, plain and in a CUDA graph. Medians in us,
variants interleaved; "graph" columns are per call, from a graph of 20 calls (GPU time without launch
gaps); fused-in-a-graph as % of the copy-bandwidth floor (8 bytes an element: read residual and
update, write residual and output) with the copy bandwidth measured in the same run. Inputs rotate
over enough sets to exceed the L2 cache, so small shapes are not timed out of cache.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from ..ops import bits_equal
from ..ops.gated_resnorm import gated_resnorm, gated_resnorm_decline_reason, gated_resnorm_reference
from .report import KernelReport, KernelRow, check_output, format_kernel_table, write_json
from .timing import copy_bandwidth_gbs, graphed, interleaved_median_us

DEFAULT_SHAPES = [
    "3072x512",
    "3072x4096",
    "3072x4608",
    "6144x64",
    "6144x512",
    "6144x4096",
    "6144x4608",
    "6144x8704",
]
L2_FLUSH_BYTES = 256 << 20
GRAPH_REPEATS = 20


def _inputs(batch: int, tokens: int, dim: int, dtype: torch.dtype):
    mod = torch.randn(batch, 1, 6 * dim, device="cuda", dtype=dtype)
    shift, scale, gate = mod.chunk(6, dim=-1)[3:]
    residual = torch.randn(batch, tokens, dim, device="cuda", dtype=dtype)
    update = torch.randn(batch, tokens, dim, device="cuda", dtype=dtype)
    return residual, update, gate, scale, shift


def _rotating(fn, sets):
    """A callable that runs `fn` on the next input set each call."""
    state = {"i": 0}

    def call():
        args = sets[state["i"] % len(sets)]
        state["i"] += 1
        return fn(*args)

    return call


def bench_shape(
    dim: int, tokens: int, batch: int, dtype: torch.dtype, copy_gbs: float, compile_chain
) -> KernelRow:
    bytes_per_set = 4 * batch * tokens * dim * torch.finfo(dtype).bits // 8
    n_sets = max(1, min(16, -(-L2_FLUSH_BYTES // bytes_per_set)))
    sets = [_inputs(batch, tokens, dim, dtype) for _ in range(n_sets)]
    if gated_resnorm_decline_reason(*sets[0]) is not None:
        raise RuntimeError(f"fused path declined D={dim} T={tokens}")
    ref = gated_resnorm_reference(*sets[0])
    got = gated_resnorm(*sets[0])
    exact = bits_equal(got[0], ref[0]) and bits_equal(got[1], ref[1])

    eager = _rotating(gated_resnorm_reference, sets)
    fused = _rotating(gated_resnorm, sets)
    # Graphs capture GRAPH_REPEATS calls, rotating over the input sets, and are timed per call.
    eager_graph = graphed(_rotating(gated_resnorm_reference, sets), GRAPH_REPEATS)
    fused_graph = graphed(_rotating(gated_resnorm, sets), GRAPH_REPEATS)
    fns = [eager, eager_graph, fused, fused_graph]
    if compile_chain is not None:
        fns.append(_rotating(compile_chain, sets))
    times = interleaved_median_us(fns)
    times[1] /= GRAPH_REPEATS
    times[3] /= GRAPH_REPEATS
    floor_us = 8 * batch * tokens * dim / (copy_gbs * 1e3) * (torch.finfo(dtype).bits / 16)
    return KernelRow(
        dim=dim,
        tokens=tokens,
        batch=batch,
        eager_us=times[0],
        eager_graph_us=times[1],
        compile_us=times[4] if compile_chain is not None else None,
        fused_us=times[2],
        fused_graph_us=times[3],
        floor_us=floor_us,
        pct_of_copy_bw=100 * floor_us / times[3],
        speedup_vs_eager=times[0] / times[2],
        speedup_vs_graph=times[1] / times[3],
        bit_exact=exact,
    )


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The kernel benchmark's options (the `flux2-fused kernel` subcommand's)."""
    parser.add_argument(
        "--shapes", nargs="*", default=DEFAULT_SHAPES, metavar="DxT", help="DxT items, e.g. 6144x4608"
    )
    parser.add_argument(
        "--batch", type=int, default=1, metavar="B", help="batch size B of [B, T, D] (default 1)"
    )
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="element type (default bf16)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the chain")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the rows to FILE")


def run(args: argparse.Namespace) -> int:
    """Benchmark every shape on the current CUDA GPU and print the table; 1 when a shape's fused
    outputs differ from eager's."""
    check_output("--json", args.json)
    compile_chain = None if args.no_compile else torch.compile(gated_resnorm_reference, dynamic=False)
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for item in args.shapes:
        dim, tokens = (int(v) for v in item.lower().split("x"))
        rows.append(bench_shape(dim, tokens, args.batch, DTYPES[args.dtype], copy_gbs, compile_chain))
        print(
            f"D={dim} T={tokens}: fused {rows[-1].fused_graph_us:.1f} us in a graph "
            f"({rows[-1].pct_of_copy_bw:.0f}% of copy BW)",
            file=sys.stderr,
        )
    report = KernelReport(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_gbs=copy_gbs, rows=rows
    )
    print(format_kernel_table(report))
    if args.json:
        write_json(asdict(report), args.json)
    return 0 if all(r.bit_exact for r in rows) else 1


if __name__ == "__main__":
    from ..cli import main

    sys.exit(main(["kernel", *sys.argv[1:]]))
