"""`flux2-fused step`: one transformer step per config and mode, its timing and kernel tables."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .tables import (
    Breakdown,
    Paired,
    Timing,
    breakdown_cells,
    breakdown_headers,
    gain_text,
    markdown_table,
    speedup_text,
    yes_no,
)


@dataclass
class OpTraffic:
    """One op's fused kernels in one profiled fused step: where each op stands against the copy
    bandwidth at the model's own shapes, as the step runs it.

    - op: the op's name (`ops.KERNEL_OPS`)
    - launches: its kernel launches in the step (a per-tensor float8_quant call launches two)
    - gb: the GB its launches read and write (`bench.traffic`)
    - kernel_ms: its kernels' summed time in the profiled step
    """

    op: str
    launches: int
    gb: float
    kernel_ms: float


@dataclass
class StepResult:
    """One config of `flux2-fused step` (its JSON is a list of these).

    - config: preset name
    - batch: batch size
    - steps: pairs of steps in each timing
    - img_tokens: image tokens a sample
    - txt_tokens: text tokens a sample
    - synchronized: Timing of steps each started on an idle GPU and waited for
    - pipelined: Timing of steps enqueued back to back, as a denoise loop runs them
    - eager_kernels: CUDA kernels an eager step launches
    - fused_kernels: CUDA kernels a fused step launches
    - fused_kernel_launches: of those, launches of this package's fused kernels (all of them)
    - eager_profile: Breakdown of the eager step's kernels (the profiled step that eager_kernels counts)
    - fused_profile: Breakdown of the fused step's kernels (the profiled step that fused_kernels counts)
    - eager_sha256: SHA-256 of the eager step's output
    - fused_sha256: SHA-256 of the fused step's output
    - bit_exact: the two outputs are torch.equal
    - compiled: both modes ran under torch.compile(model)
    - host: the model timed: "package" (the package's Flux2Transformer, eager = `fused = False`) or
      "diffusers" (diffusers' Flux2Transformer2DModel with the same weights, eager = diffusers' own
      forward, fused = `enable(model)`)
    - lora_rank: rank of the peft LoRA on the diffusers host's attention and MLP linears, null for none
    - offload: the diffusers host's CPU offload: "none", "model" (accelerate's hook, as
      enable_model_cpu_offload) or "group" (block-level group offloading on a side stream)
    - quantization: the diffusers host's torchao dynamic quantization of the blocks' linears: "none",
      "float8-row", "float8-tensor" or "int8"
    - width: image width in pixels (img_tokens laid out as that image's rows), null when given as tokens
    - height: image height in pixels, null when given as tokens
    - busy_pct: by mode ("eager", "fused", "compiled" with --vs-compile, "graph" with --graph), the
      GPU's busy share (%) of a few pipelined steps under torch.profiler: the union of its kernels,
      copies and memsets over the span from the first start to the last end; below 100 the GPU
      waited for the host (the profiler's own launch overhead included)
    - host_ms: by mode, as busy_pct, the median CPU time (ms) Python takes to issue one step, each
      started with the GPU idle and not waited for; where it reaches the pipelined step time, the
      host sets the pace, not the GPU
    - compiled_ms: with --vs-compile, the median pipelined step of torch.compile(model) running the
      eager forward, timed in turn with the eager and fused steps of `pipelined`; else null
    - compiled_vs_fused: with --vs-compile, Paired of those compiled steps against the fused steps of
      `pipelined`, each with the fused step of its round (diff_ms positive when fused is faster); else
      null
    - compiled_sha256: SHA-256 of that compiled step's output (Inductor's bits, not eager's), or null
    - compiled_fused_ms: with --vs-compile both, the median pipelined step of torch.compile(model)
      running the fused forward (its sites flux2_fused operators), timed in turn with the others; else
      null
    - compiled_fused_sha256: SHA-256 of that step's output, or null
    - graph_ms: with --graph, the median pipelined step of the fused step captured in a CUDA graph and
      replayed, timed in turn with the eager and fused steps of `pipelined`; else null
    - graph_bit_exact: with --graph, whether the replayed step's output equals the eager step's; else
      null
    - floor_ms: with --floor, the median pipelined replay (a CUDA graph) of the fused step's GEMM and
      attention calls alone, timed in turn with the others: what an exact step can at best reach
      (`bench.floor`); else null
    - floor_profile: with --floor, the Breakdown of one such replay (its GEMM and attention kernel
      time should match the fused step's); else null
    - copied_ms: with --floor, the median pipelined replay of those calls with each fused launch
      replaced by a device copy of the bytes it moves, in its place (`bench.floor`'s copied step):
      below fused_ms where the fused kernels move their bytes faster in the step than copies would;
      else null
    - copied_profile: with --floor, the Breakdown of one such replay (the copies count as other);
      else null
    - fused_gb: the GB the fused kernels' launches move in one fused step (`bench.traffic`: each
      launch's tensor arguments, read or written once), null where not counted
    - copy_gbs: the GPU's device-to-device copy bandwidth in GB/s (read plus write) in this run: the
      fused kernels' bandwidth in the step (fused_gb over the fused step's profiled fused kernel
      time) is shown as a percentage of it
    - fused_ops: OpTraffic of each op with a launch in the fused step, in the order each first
      launched (their gb sum to fused_gb); empty where not counted
    - reference_tokens: FLUX.3's reference image tokens a sample (image-to-image), 0 for none
    - block: pipelined steps a mode runs in a row (--block; 1: the modes alternate every step); the
      pipelined timings pair steps * block steps a mode
    - lead_in: untimed steps of a mode before each of its pipelined blocks (--lead-in)
    """

    config: str
    batch: int
    steps: int
    img_tokens: int
    txt_tokens: int
    synchronized: Timing
    pipelined: Timing
    eager_kernels: int
    fused_kernels: int
    fused_kernel_launches: int
    eager_profile: Breakdown
    fused_profile: Breakdown
    eager_sha256: str
    fused_sha256: str
    bit_exact: bool
    compiled: bool = False
    host: str = "package"
    lora_rank: int | None = None
    offload: str = "none"
    quantization: str = "none"
    width: int | None = None
    height: int | None = None
    busy_pct: dict[str, float] = field(default_factory=dict)
    host_ms: dict[str, float] = field(default_factory=dict)
    compiled_ms: float | None = None
    compiled_vs_fused: Paired | None = None
    compiled_sha256: str | None = None
    compiled_fused_ms: float | None = None
    compiled_fused_sha256: str | None = None
    graph_ms: float | None = None
    graph_bit_exact: bool | None = None
    floor_ms: float | None = None
    floor_profile: Breakdown | None = None
    copied_ms: float | None = None
    copied_profile: Breakdown | None = None
    fused_gb: float | None = None
    copy_gbs: float | None = None
    fused_ops: list[OpTraffic] = field(default_factory=list)
    reference_tokens: int = 0
    block: int = 1
    lead_in: int = 0

    @property
    def size_label(self) -> str:
        """The image size and token counts, as the tables name a row's shape."""
        tokens = f"{self.img_tokens}+{self.txt_tokens}"
        if self.reference_tokens:
            tokens += f"+{self.reference_tokens} ref"
        return tokens if self.width is None else f"{self.width}x{self.height} ({tokens})"

    @property
    def host_label(self) -> str:
        """The host and its setup in words, as the tables name a row's model."""
        setup = (
            ([f"torchao {self.quantization}"] if self.quantization != "none" else [])
            + ([f"LoRA r{self.lora_rank}"] if self.lora_rank is not None else [])
            + ([f"{self.offload} offload"] if self.offload != "none" else [])
        )
        return f"{self.host} ({', '.join(setup)})" if setup else self.host


def format_step_table(results: Sequence[StepResult], device: str, torch_version: str) -> str:
    """The step benchmark's tables: timings, two rows (synchronized, pipelined) a config; then the
    kernel breakdown of one profiled step, two rows (eager, fused) a config."""
    compiled = "  torch.compile(model): bit-exact column compares two compiled graphs"
    title = f"GPU: {device}  torch {torch_version}  bf16, random weights" + (
        compiled if results and results[0].compiled else ""
    )
    if any(r.host == "diffusers" for r in results):
        title += "\n(host diffusers: eager = diffusers' own forward, fused = enable(model))"
    headers = [
        "config",
        "host",
        "B",
        "size (img+txt tokens)",
        "timing",
        "eager ms",
        "fused ms",
        "speedup",
        "compiled ms (fused vs it)",
        "fused vs compiled: paired gain ms (95% CI), fused won",
        "compiled + fused ms (vs compiled)",
        "CUDA graph ms (vs fused)",
        "GEMM + attention alone ms (fused above it)",
        "with the fused bytes copied ms (fused above it)",
        "GPU busy %",
        "host ms a step",
        "paired gain ms (95% CI)",
        "fused won",
        "kernels/step eager -> fused",
        "fused launches",
        "bit-exact",
        "SHA-256 (both)",
    ]
    rows = []
    for r in results:
        sha = r.fused_sha256[:16] if r.bit_exact else f"{r.eager_sha256[:12]} / {r.fused_sha256[:12]}"
        blocks = "pipelined" + (f", blocks of {r.block}" if r.block > 1 else "")
        blocks += f" after {r.lead_in}" if r.lead_in else ""
        for label, t in (("synchronized", r.synchronized), (blocks, r.pipelined)):
            pipelined = label != "synchronized"
            pairs = r.steps * r.block if pipelined else r.steps
            compiled = vs_compiled = compiled_fused = graph = floor = copied = "-"
            if pipelined and r.compiled_ms is not None:
                compiled = f"{r.compiled_ms:.2f} ({speedup_text(100 * (r.compiled_ms / t.fused_ms - 1))})"
            if pipelined and r.compiled_vs_fused is not None:
                p = r.compiled_vs_fused
                vs_compiled = f"{gain_text(p.diff_ms, p.ci95_ms)}, {p.fused_won}/{pairs}"
            if pipelined and r.compiled_fused_ms is not None and r.compiled_ms is not None:
                gain = speedup_text(100 * (r.compiled_ms / r.compiled_fused_ms - 1))
                compiled_fused = f"{r.compiled_fused_ms:.2f} ({gain})"
            if pipelined and r.graph_ms is not None:
                exact = "bit-exact" if r.graph_bit_exact else "NOT bit-exact"
                graph = f"{r.graph_ms:.2f} ({speedup_text(100 * (t.fused_ms / r.graph_ms - 1))}), {exact}"
            if pipelined and r.floor_ms is not None:
                floor = f"{r.floor_ms:.2f} ({100 * (t.fused_ms / r.floor_ms - 1):+.1f}%)"
            if pipelined and r.copied_ms is not None:
                copied = f"{r.copied_ms:.2f} ({100 * (t.fused_ms / r.copied_ms - 1):+.1f}%)"
            busy = " / ".join(f"{m} {pct:.1f}" for m, pct in r.busy_pct.items()) if pipelined else "-"
            host = " / ".join(f"{m} {ms:.2f}" for m, ms in r.host_ms.items()) if pipelined else "-"
            rows.append(
                [
                    r.config,
                    r.host_label,
                    r.batch,
                    r.size_label,
                    label,
                    f"{t.eager_ms:.2f}",
                    f"{t.fused_ms:.2f}",
                    speedup_text(t.speedup_pct),
                    compiled,
                    vs_compiled,
                    compiled_fused,
                    graph,
                    floor,
                    copied,
                    busy or "-",
                    host or "-",
                    gain_text(t.paired_diff_ms, t.paired_ci95_ms),
                    f"{t.fused_won}/{pairs}",
                    f"{r.eager_kernels} -> {r.fused_kernels}",
                    r.fused_kernel_launches,
                    yes_no(r.bit_exact),
                    sha,
                ]
            )
    tables = [title, markdown_table(headers, rows), "", format_breakdown_table(results)]
    if any(r.fused_ops for r in results):
        tables += ["", format_traffic_table(results)]
    return "\n".join(tables)


def format_breakdown_table(results: Sequence[StepResult]) -> str:
    """Where each mode's step spends its kernel time: GEMM and attention, which the fused path leaves
    alone, against the fused kernels and the other eager kernels they replace; and the bytes the
    fused kernels move, at what share of the copy bandwidth."""
    headers = ["config", "host", "B", "size", "mode", "kernels", *breakdown_headers()]
    headers.append("fused GB (their TB/s of the copy's, %)")
    rows = []
    for r in results:
        profiles = [("eager", r.eager_profile), ("fused", r.fused_profile)]
        if r.floor_profile is not None:
            profiles.append(("GEMM + attention alone", r.floor_profile))
        if r.copied_profile is not None:
            profiles.append(("with the fused bytes copied (as other)", r.copied_profile))
        for mode, b in profiles:
            shape = [r.batch, r.size_label]
            traffic = _traffic_cell(r, b) if mode == "fused" else "-"
            cells = [b.total_launches, *breakdown_cells(b), traffic]
            rows.append([r.config, r.host_label, *shape, mode, *cells])
    note = (
        "(kernel time of one profiled step by kernel class, torch.profiler; the total is their sum; "
        "fused GB: what the fused kernels' launches read and write in a step, and their bandwidth over "
        "their profiled time against a device copy's measured in the same process)"
    )
    return f"{markdown_table(headers, rows)}\n{note}"


def _traffic_cell(r: StepResult, fused: Breakdown) -> str:
    """The fused kernels' GB a step and their bandwidth in it as % of the copy bandwidth, where known."""
    ms = fused.kernel_ms.get("fused", 0.0)
    if r.fused_gb is None:
        return "-"
    if r.copy_gbs is None or ms <= 0:
        return f"{r.fused_gb:.2f}"
    gbs = r.fused_gb / (ms * 1e-3)
    return f"{r.fused_gb:.2f} ({gbs / 1e3:.2f} of {r.copy_gbs / 1e3:.2f} TB/s, {100 * gbs / r.copy_gbs:.0f}%)"


def format_traffic_table(results: Sequence[StepResult]) -> str:
    """Each op's fused kernels in the profiled fused step: launches, bytes, time, and their bandwidth
    as a share of the copy bandwidth measured in the same process."""
    headers = [
        "config",
        "host",
        "B",
        "size",
        "op",
        "launches",
        "GB",
        "kernel ms",
        "TB/s",
        "% of copy bandwidth",
    ]
    rows = []
    for r in results:
        for t in r.fused_ops:
            gbs = t.gb / (t.kernel_ms * 1e-3) if t.kernel_ms > 0 else None
            share = "-" if gbs is None or r.copy_gbs is None else f"{100 * gbs / r.copy_gbs:.0f}%"
            tbs = "-" if gbs is None else f"{gbs / 1e3:.2f}"
            cells = [t.op, t.launches, f"{t.gb:.2f}", f"{t.kernel_ms:.2f}", tbs, share]
            rows.append([r.config, r.host_label, r.batch, r.size_label, *cells])
    note = (
        "(each op's launches in the profiled fused step, the bytes they read and write, their summed "
        "kernel time, and their bandwidth against a device copy's measured in the same process)"
    )
    return f"{markdown_table(headers, rows)}\n{note}"
