"""Kernel benchmark: one FLUX.2 site (gated residual + LayerNorm + adaLN), eager vs fused.

    python -m flux2_fused.bench.kernel [--shapes 6144x4608 3072x4096 ...] [--no-compile] [--json FILE]

For each (D, T): the eager chain, the eager chain replayed from a CUDA graph, torch.compile of the
chain (not bit-exact; for reference), and the fused kernel, plain and in a CUDA graph. Medians in us,
variants interleaved; "graph" columns are per call, from a graph of 20 calls (GPU time without launch
gaps); fused-in-a-graph as % of the copy-bandwidth floor (8 bytes an element: read residual and
update, write residual and output) with the copy bandwidth measured in the same run. Inputs rotate
over enough sets to exceed the L2 cache, so small shapes are not timed out of cache.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import torch

from ..ops import bits_equal
from ..ops.gated_resnorm import gated_resnorm, gated_resnorm_decline_reason, gated_resnorm_reference
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


@dataclass
class Row:
    dim: int
    tokens: int
    batch: int
    eager_us: float
    eager_graph_us: float
    compile_us: float | None
    fused_us: float
    fused_graph_us: float
    floor_us: float
    pct_of_copy_bw: float
    speedup_vs_eager: float
    speedup_vs_graph: float
    bit_exact: bool


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


def bench_shape(dim: int, tokens: int, batch: int, dtype: torch.dtype, copy_gbs: float, compile_chain) -> Row:
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
    return Row(
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


def format_table(rows: list[Row], copy_gbs: float) -> str:
    lines = [
        f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"copy bandwidth {copy_gbs / 1e3:.2f} TB/s",
        "| D | T | B | eager us | eager graph us | compile us | fused us | fused graph us | floor us "
        "| % copy BW | x eager | x graph | exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        comp = f"{r.compile_us:.1f}" if r.compile_us is not None else "-"
        lines.append(
            f"| {r.dim} | {r.tokens} | {r.batch} | {r.eager_us:.1f} | {r.eager_graph_us:.1f} | {comp} "
            f"| {r.fused_us:.1f} | {r.fused_graph_us:.1f} | {r.floor_us:.1f} | {r.pct_of_copy_bw:.1f} "
            f"| {r.speedup_vs_eager:.2f} | {r.speedup_vs_graph:.2f} | {'yes' if r.bit_exact else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES, help="DxT items, e.g. 6144x4608")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the chain")
    parser.add_argument("--json", help="write the rows to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("flux2-fused kernel benchmark: needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    compile_chain = None if args.no_compile else torch.compile(gated_resnorm_reference, dynamic=False)
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for item in args.shapes:
        dim, tokens = (int(v) for v in item.lower().split("x"))
        rows.append(bench_shape(dim, tokens, args.batch, dtype, copy_gbs, compile_chain))
        print(
            f"D={dim} T={tokens}: fused {rows[-1].fused_graph_us:.1f} us in a graph "
            f"({rows[-1].pct_of_copy_bw:.0f}% of copy BW)",
            file=sys.stderr,
        )
    print(format_table(rows, copy_gbs))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "copy_gbs": copy_gbs,
                    "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "rows": [asdict(r) for r in rows],
                },
                fh,
                indent=2,
            )
    return 0 if all(r.bit_exact for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
