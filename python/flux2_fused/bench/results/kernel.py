"""`flux2-fused kernel`: each fused op's sites alone, and their table."""

from __future__ import annotations

from dataclasses import dataclass

from .tables import markdown_table, yes_no


@dataclass
class KernelRow:
    """One site of `flux2-fused kernel`; times in us, medians.

    - op: the fused op (gated_resnorm, qk_norm_rope, swiglu)
    - dim: D, the width of a row (the hidden size; qk_norm_rope: heads x 128; swiglu: H)
    - tokens: T, tokens a sample
    - batch: B
    - eager_us: the eager chain, plain calls
    - eager_graph_us: the eager chain per call in a CUDA graph
    - compile_us: torch.compile of the chain (not bit-exact), null with --no-compile
    - fused_us: the fused kernel, plain calls
    - fused_graph_us: the fused kernel per call in a CUDA graph
    - floor_us: the copy-bandwidth floor: the bytes the site must read and write, at the copy
      bandwidth of a 2 GiB copy measured in the same run (a stream with no start or end)
    - pct_of_copy_bw: 100 * floor_us / fused_graph_us
    - copy_graph_us: one device copy moving those same bytes (read plus written), per call in a CUDA
      graph of 20, timed with the variants: a kernel of the site's size, with its ramp and tail
    - pct_of_copy: 100 * copy_graph_us / fused_graph_us
    - speedup_vs_eager: eager_us / fused_us
    - speedup_vs_graph: eager_graph_us / fused_graph_us
    - bit_exact: the fused outputs equal the eager chain's bit for bit
    """

    op: str
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
    copy_graph_us: float
    pct_of_copy: float
    speedup_vs_eager: float
    speedup_vs_graph: float
    bit_exact: bool


@dataclass
class KernelReport:
    """The JSON of `flux2-fused kernel --json FILE`.

    - gpu: GPU name
    - torch: torch version
    - copy_gbs: device-to-device copy bandwidth measured in the same run, GB/s (read + written)
    - rows: one KernelRow a shape
    """

    gpu: str
    torch: str
    copy_gbs: float
    rows: list[KernelRow]


def format_kernel_table(report: KernelReport) -> str:
    """The kernel benchmark's table, one row a shape."""
    headers = [
        "op",
        "D",
        "T",
        "B",
        "eager us",
        "eager graph us",
        "compile us",
        "fused us",
        "fused graph us",
        "floor us",
        "% copy BW",
        "copy graph us",
        "% copy",
        "x eager",
        "x graph",
        "exact",
    ]
    rows = [
        [
            r.op,
            r.dim,
            r.tokens,
            r.batch,
            f"{r.eager_us:.1f}",
            f"{r.eager_graph_us:.1f}",
            f"{r.compile_us:.1f}" if r.compile_us is not None else "-",
            f"{r.fused_us:.1f}",
            f"{r.fused_graph_us:.1f}",
            f"{r.floor_us:.1f}",
            f"{r.pct_of_copy_bw:.1f}",
            f"{r.copy_graph_us:.1f}",
            f"{r.pct_of_copy:.1f}",
            f"{r.speedup_vs_eager:.2f}",
            f"{r.speedup_vs_graph:.2f}",
            yes_no(r.bit_exact),
        ]
        for r in report.rows
    ]
    title = f"GPU: {report.gpu}  torch {report.torch}  copy bandwidth {report.copy_gbs / 1e3:.2f} TB/s"
    return f"{title}\n{markdown_table(headers, rows)}"
