"""What the benchmarks and `verify` report: the result types (their fields are the JSON fields, each
documented on its class), the text formatters, and where the files go.

No torch here: the plot and the formatters need only the figures, so drawing or printing a report
never imports a model, and the benchmark modules and the plot share these types without importing
each other.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

MODES = ("eager", "fused")
# The classes of kernel (bench/classify.py's table names them) each benchmark splits a profiled step
# by: `flux2-fused bench` the sites the fused ops change, `flux2-fused step` what takes its GPU time.
SITES = ("fused", "norm", "elementwise", "other")
KERNEL_CLASSES = ("gemm", "attention", "fused", "collective", "other")
INACTIVE = "n/a (fast path inactive)"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table, so every table can be pasted into the README as printed."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def speedup_text(pct: float | None) -> str:
    """A speedup for people: signed percent, or why there is none."""
    return INACTIVE if pct is None else f"{pct:+.1f}%"


def _gain_text(diff_ms: float, ci95_ms: float) -> str:
    """A paired gain in ms and the half-width of its 95% confidence interval, as the step table prints
    each (eager vs fused, compiled vs fused)."""
    return f"{diff_ms:+.2f} +- {ci95_ms:.2f}"


# --------------------------------------------------------------------------- output files


def write_json(data: object, path: Path) -> None:
    """`data` (dataclasses already turned into dicts) as indented JSON."""
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- flux2-fused bench


@dataclass
class ModeResult:
    """One mode of `flux2-fused bench` (the JSON's `eager` and `fused` objects); times in ms.

    - step_ms: time of each timed step, in order
    - median_ms: median of step_ms
    - warmup_s: the untimed warm-up step in s (fused, where the fast path is on: includes the kernel
      build or load and self-check)
    - launches_per_step: CUDA kernels (on the CPU: aten ops, nested ones included) in the profiled step
    - site_ms: kernel time (CPU: op self time) of the profiled step by site: fused, norm, elementwise, other
    - site_launches: launches of the profiled step by the same sites
    - sha256: SHA-256 of the final latents' bytes
    """

    step_ms: list[float]
    median_ms: float
    warmup_s: float
    launches_per_step: int
    site_ms: dict[str, float]
    site_launches: dict[str, int]
    sha256: str


@dataclass
class BenchReport:
    """Every figure of `flux2-fused bench`: the summary's and the JSON's (`--json FILE`; times in ms
    unless the name says s).

    - flux2_fused: package version
    - torch: torch version
    - device: the torch device the run used ("cuda:0", "cpu")
    - gpu: GPU name, null on the CPU
    - compute_capability: "major.minor", null on the CPU
    - config: preset name (dev, klein-4b, klein-9b, tiny), or "custom" for weights matching none
    - weights: the weights folder, null for random weights
    - inner_dim: D, the width of the residual streams
    - double_blocks: number of double-stream blocks
    - single_blocks: number of single-stream blocks
    - params: parameter count
    - dtype: bf16, fp16 or fp32
    - height: image height in pixels
    - width: image width in pixels
    - batch: batch size
    - image_tokens: image tokens a sample, (height / 16) * (width / 16)
    - text_tokens: text tokens a sample
    - steps: timed denoise steps a mode
    - seed: seed of the weights, latents and text embeddings
    - guidance: the guidance value given to the model, null when the config has no guidance embedder
    - schedule: the sigma schedule and update rule, in words
    - launch_unit: what launches_per_step counts ("cuda kernels" or "aten ops")
    - eager: the eager mode's results (ModeResult)
    - fused: the fused mode's results (ModeResult)
    - speedup_pct: 100 * (eager median / fused median - 1), positive when fused is faster; null when
      the fast path was not active (both modes then ran the same eager code, and their difference is noise)
    - bit_exact: the final latents of both modes are identical (torch.equal and equal SHA-256)
    - fused_active: the fused kernel really ran in the fused mode (self-check passed, launches seen)
    - fused_status: why the fused path was or was not active, in words
    - self_checks: the kernel self-check verdicts of this process: op, device, config (e.g. "D=3072
      bfloat16"), passed, detail, seconds
    - notes: the notes printed before the run (machine-dependent choices, fallbacks, estimates)
    - build_s: seconds to build or load the model
    - total_s: seconds for the whole run
    """

    flux2_fused: str
    torch: str
    device: str
    gpu: str | None
    compute_capability: str | None
    config: str
    weights: str | None
    inner_dim: int
    double_blocks: int
    single_blocks: int
    params: int
    dtype: str
    height: int
    width: int
    batch: int
    image_tokens: int
    text_tokens: int
    steps: int
    seed: int
    guidance: float | None
    schedule: str
    launch_unit: str
    eager: ModeResult
    fused: ModeResult
    speedup_pct: float | None
    bit_exact: bool
    fused_active: bool
    fused_status: str
    self_checks: list[dict]
    notes: list[str]
    build_s: float
    total_s: float


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def format_summary(r: BenchReport) -> str:
    """The human-readable report: setup, the per-mode table, the fused-path status and the verdict."""
    source = r.weights or f"random weights, seed {r.seed}"
    device = f"{r.gpu} (sm {r.compute_capability})" if r.gpu else "CPU"
    guidance = f"guidance {r.guidance}" if r.guidance is not None else "no guidance embedder"
    rows = []
    for mode in MODES:
        m: ModeResult = getattr(r, mode)
        speedup = "-" if mode == "eager" else speedup_text(r.speedup_pct)
        sites = [f"{m.site_ms[site]:.2f}" for site in SITES]
        rows.append([mode, f"{m.median_ms:.2f}", speedup, m.launches_per_step, *sites, f"{m.warmup_s:.2f}"])
    headers = ["mode", "median ms/step", "speedup", f"{r.launch_unit}/step"]
    headers += [f"{site} ms" for site in SITES] + ["warm-up s"]
    return "\n".join(
        [
            f"flux2-fused bench: {r.config} (D={r.inner_dim}, {r.double_blocks} double + {r.single_blocks} "
            f"single blocks, {_count(r.params)} params, {source}), {r.dtype}",
            f"{r.height}x{r.width} px = {r.image_tokens} image + {r.text_tokens} text tokens, "
            f"batch {r.batch}, {guidance}; {r.schedule}",
            f"device: {device}, torch {r.torch}, flux2-fused {r.flux2_fused}",
            f"fused path: {'active' if r.fused_active else 'NOT active'}: {r.fused_status}",
            "",
            markdown_table(headers, rows),
            f"(site ms: {'kernel time' if r.gpu else 'aten op self time'} of one profiled step)",
            "",
            f"bit-exact: {_yes(r.bit_exact)} (final latents of both modes, torch.equal and SHA-256)",
            f"  sha256 eager {r.eager.sha256}",
            f"  sha256 fused {r.fused.sha256}",
        ]
    )


# --------------------------------------------------------------------------- flux2-fused step


@dataclass
class Paired:
    """The fused step against another mode timed in turn with it: the difference of each pair (the
    two steps at the same position), so clock drift from pair to pair, which hits both steps of a
    pair alike, does not widen the interval as it would the medians' spread.

    - diff_ms: mean over pairs of (other - fused), positive when fused is faster
    - ci95_ms: half-width of the 95% confidence interval of diff_ms (NaN for one pair)
    - fused_won: pairs where the fused step was faster
    """

    diff_ms: float
    ci95_ms: float
    fused_won: int

    @classmethod
    def of(cls, other: Sequence[float], fused: Sequence[float]) -> Paired:
        """From the two modes' step times, paired by position."""
        diffs = [o - f for o, f in zip(other, fused, strict=True)]
        ci95 = 1.96 * statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
        return cls(diff_ms=statistics.mean(diffs), ci95_ms=ci95, fused_won=sum(d > 0 for d in diffs))


@dataclass
class Timing:
    """Interleaved step times of the two modes: medians and the paired (same position) difference.

    - eager_ms: median eager step time
    - fused_ms: median fused step time
    - speedup_pct: 100 * (eager_ms / fused_ms - 1), positive when fused is faster
    - paired_diff_ms: mean over pairs of (eager - fused)
    - paired_ci95_ms: half-width of the 95% confidence interval of paired_diff_ms (NaN for one pair)
    - fused_won: pairs where the fused step was faster
    """

    eager_ms: float
    fused_ms: float
    speedup_pct: float
    paired_diff_ms: float
    paired_ci95_ms: float
    fused_won: int

    @classmethod
    def of(cls, times: dict[bool, list[float]]) -> Timing:
        """From the step times by mode (False: eager, True: fused), paired by position (`Paired`)."""
        eager_ms, fused_ms = statistics.median(times[False]), statistics.median(times[True])
        paired = Paired.of(times[False], times[True])
        return cls(
            eager_ms=eager_ms,
            fused_ms=fused_ms,
            speedup_pct=100 * (eager_ms / fused_ms - 1),
            paired_diff_ms=paired.diff_ms,
            paired_ci95_ms=paired.ci95_ms,
            fused_won=paired.fused_won,
        )


@dataclass
class Breakdown:
    """The CUDA kernels of one profiled step of one mode (torch.profiler), by kernel class: gemm
    (cuBLAS / CUTLASS matrix products), attention (SDPA: flash, cuDNN, memory-efficient), fused (this
    package's kernels), collective (NCCL, under a parallel plan) and other (the remaining eager
    kernels: elementwise, norms, copies, ...). It says where a step's GPU time goes, so a speedup can
    be set against the share the fused ops touch.

    - kernel_ms: summed kernel time in ms by class (keys: KERNEL_CLASSES)
    - launches: kernel launches by the same classes
    """

    kernel_ms: dict[str, float]
    launches: dict[str, int]

    @property
    def total_ms(self) -> float:
        """Summed time of all the step's kernels: on one stream its GPU busy time, launch gaps excluded."""
        return sum(self.kernel_ms.values())

    @property
    def total_launches(self) -> int:
        return sum(self.launches.values())


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
    - reference_tokens: FLUX.3's reference image tokens a sample (image-to-image), 0 for none
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
    compiled_ms: float | None = None
    compiled_vs_fused: Paired | None = None
    compiled_sha256: str | None = None
    compiled_fused_ms: float | None = None
    compiled_fused_sha256: str | None = None
    graph_ms: float | None = None
    graph_bit_exact: bool | None = None
    floor_ms: float | None = None
    floor_profile: Breakdown | None = None
    reference_tokens: int = 0

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


_CLASS_LABELS = {
    "gemm": "GEMM",
    "attention": "attention",
    "fused": "fused",
    "collective": "NCCL",
    "other": "other",
}


def _breakdown_cells(b: Breakdown) -> list[str]:
    """A breakdown's kernel ms (launches) by class, then the total kernel ms."""
    return [f"{b.kernel_ms[c]:.2f} ({b.launches[c]})" for c in KERNEL_CLASSES] + [f"{b.total_ms:.2f}"]


def _breakdown_headers() -> list[str]:
    return [f"{_CLASS_LABELS[c]} ms (launches)" for c in KERNEL_CLASSES] + ["total kernel ms"]


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
        "GPU busy %",
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
        for label, t in (("synchronized", r.synchronized), ("pipelined", r.pipelined)):
            pipelined = label == "pipelined"
            compiled = vs_compiled = compiled_fused = graph = floor = "-"
            if pipelined and r.compiled_ms is not None:
                compiled = f"{r.compiled_ms:.2f} ({speedup_text(100 * (r.compiled_ms / t.fused_ms - 1))})"
            if pipelined and r.compiled_vs_fused is not None:
                p = r.compiled_vs_fused
                vs_compiled = f"{_gain_text(p.diff_ms, p.ci95_ms)}, {p.fused_won}/{r.steps}"
            if pipelined and r.compiled_fused_ms is not None and r.compiled_ms is not None:
                gain = speedup_text(100 * (r.compiled_ms / r.compiled_fused_ms - 1))
                compiled_fused = f"{r.compiled_fused_ms:.2f} ({gain})"
            if pipelined and r.graph_ms is not None:
                exact = "bit-exact" if r.graph_bit_exact else "NOT bit-exact"
                graph = f"{r.graph_ms:.2f} ({speedup_text(100 * (t.fused_ms / r.graph_ms - 1))}), {exact}"
            if pipelined and r.floor_ms is not None:
                floor = f"{r.floor_ms:.2f} ({100 * (t.fused_ms / r.floor_ms - 1):+.1f}%)"
            busy = " / ".join(f"{m} {pct:.1f}" for m, pct in r.busy_pct.items()) if pipelined else "-"
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
                    busy or "-",
                    _gain_text(t.paired_diff_ms, t.paired_ci95_ms),
                    f"{t.fused_won}/{r.steps}",
                    f"{r.eager_kernels} -> {r.fused_kernels}",
                    r.fused_kernel_launches,
                    _yes(r.bit_exact),
                    sha,
                ]
            )
    return "\n".join([title, markdown_table(headers, rows), "", format_breakdown_table(results)])


def format_breakdown_table(results: Sequence[StepResult]) -> str:
    """Where each mode's step spends its kernel time: GEMM and attention, which the fused path leaves
    alone, against the fused kernels and the other eager kernels they replace."""
    headers = ["config", "host", "B", "size", "mode", "kernels", *_breakdown_headers()]
    rows = []
    for r in results:
        profiles = [("eager", r.eager_profile), ("fused", r.fused_profile)]
        if r.floor_profile is not None:
            profiles.append(("GEMM + attention alone", r.floor_profile))
        for mode, b in profiles:
            shape = [r.batch, r.size_label]
            rows.append([r.config, r.host_label, *shape, mode, b.total_launches, *_breakdown_cells(b)])
    note = "(kernel time of one profiled step by kernel class, torch.profiler; the total is their sum)"
    return f"{markdown_table(headers, rows)}\n{note}"


# --------------------------------------------------------------------------- flux2-fused pipeline


@dataclass
class PipelineResult:
    """One config of `flux2-fused pipeline` (its JSON is a list of these); times in ms a pipeline call.

    - config: transformer preset (a Klein one: the pipeline is Flux2KleinPipeline; dev: Flux2Pipeline)
    - height: image height in pixels
    - width: image width in pixels
    - steps: denoise steps a call
    - guidance_scale: Klein: the CFG scale, above 1 each step calls the transformer twice (prompt,
      negative); dev: the embedded guidance, one call a step
    - txt_tokens: tokens of the prompt embeddings, and of the negative ones
    - pairs: timed pairs of calls
    - cache: the cache stacked on the transformer ("none", "cache-dit": DBCache, "magcache"), with
      a fixed schedule of skipped steps (`bench.pipeline.computed_steps`)
    - fused_launches: fused kernel launches in one profiled call with enable(pipe): the fused work
      the cache left (klein-4B: 96 a transformer call)
    - diffusers: diffusers version
    - timing: Timing of whole calls, each from an idle GPU and waited for (eager: the pipeline alone;
      fused: after enable(pipe))
    - diffusers_sha256: SHA-256 of the pipeline's image alone (output_type "pt", after VAE decode)
    - fused_sha256: SHA-256 of the image with enable(pipe)
    - images_equal: the two images are torch.equal
    """

    config: str
    height: int
    width: int
    steps: int
    guidance_scale: float
    txt_tokens: int
    pairs: int
    cache: str
    fused_launches: int
    diffusers: str
    timing: Timing
    diffusers_sha256: str
    fused_sha256: str
    images_equal: bool


def format_pipeline_table(results: Sequence[PipelineResult], device: str, torch_version: str) -> str:
    """The pipeline benchmark's table, one row a config."""
    headers = [
        "config",
        "image",
        "steps",
        "CFG",
        "cache",
        "diffusers ms/call",
        "enable() ms/call",
        "speedup",
        "paired gain ms (95% CI)",
        "fused won",
        "fused launches/call",
        "saved us per fused launch",
        "images equal",
        "SHA-256 (both)",
    ]
    rows = []
    for r in results:
        t = r.timing
        sha = r.fused_sha256[:16] if r.images_equal else f"{r.diffusers_sha256[:12]} / {r.fused_sha256[:12]}"
        rows.append(
            [
                r.config,
                f"{r.height}x{r.width}",
                r.steps,
                r.guidance_scale,
                r.cache,
                f"{t.eager_ms:.1f}",
                f"{t.fused_ms:.1f}",
                speedup_text(t.speedup_pct),
                f"{t.paired_diff_ms:+.1f} +- {t.paired_ci95_ms:.1f}",
                f"{t.fused_won}/{r.pairs}",
                r.fused_launches,
                f"{1000 * t.paired_diff_ms / r.fused_launches:.1f}" if r.fused_launches else "-",
                _yes(r.images_equal),
                sha,
            ]
        )
    diffusers = results[0].diffusers if results else "?"
    title = (
        f"GPU: {device}  torch {torch_version}  diffusers {diffusers}  bf16, random weights; "
        "a pipeline call (Flux2KleinPipeline, dev: Flux2Pipeline): text embeddings given, denoise loop, "
        "VAE decode"
    )
    return f"{title}\n{markdown_table(headers, rows)}"


# --------------------------------------------------------------------------- flux2-fused kernel


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
            _yes(r.bit_exact),
        ]
        for r in report.rows
    ]
    title = f"GPU: {report.gpu}  torch {report.torch}  copy bandwidth {report.copy_gbs / 1e3:.2f} TB/s"
    return f"{title}\n{markdown_table(headers, rows)}"


# --------------------------------------------------------------------------- flux2-fused verify


@dataclass
class VerifyRow:
    """One self-check of `flux2-fused verify` (printed, not written as JSON).

    - op: the fused operation checked
    - config: the configuration checked, e.g. "D=3072 bf16"
    - passed: the kernel's outputs equal live eager bit for bit
    - detail: what was compared, or why it failed
    - seconds: wall time of the check
    - module: where the op's module came from, "bundled (file)" (prebuilt in the wheel), "cache",
      "built now" (a JIT build with the local CUDA toolkit) or "unavailable", and the GPU
      architecture it runs on
    """

    op: str
    config: str
    passed: bool
    detail: str
    seconds: float
    module: str = "-"


def format_verify(rows: Sequence[VerifyRow], device: str, torch_version: str) -> str:
    """The verify table and its verdict."""
    table = markdown_table(
        ["op", "module", "config", "passed", "detail", "seconds"],
        [[r.op, r.module, r.config, _yes(r.passed), r.detail, f"{r.seconds:.3f}"] for r in rows],
    )
    failed = sum(not r.passed for r in rows)
    verdict = "all bit-exact" if not failed else f"{failed} of {len(rows)} FAILED"
    return f"flux2-fused verify on {device}, torch {torch_version}\n{table}\n{verdict}"


@dataclass
class ParallelResult:
    """One run of `flux2-fused bench --parallel` (its JSON is this object).

    - config: preset name
    - plan: the parallel degrees, e.g. "ulysses=2"
    - backend: diffusers' attention backend in both modes and on one GPU
    - world: ranks (GPUs) in the job
    - device: the GPU's name
    - batch: batch size
    - img_tokens: image tokens a sample
    - txt_tokens: text tokens a sample
    - steps: interleaved pairs of steps in each timing
    - single_diffusers_ms: median step on rank 0's GPU alone, diffusers' forward
    - single_fused_ms: the same with `enable()`
    - diffusers_ms: median step under the plan, diffusers' forward (the slowest rank's median)
    - fused_ms: the same with `enable()`
    - bit_exact: the fused output equals diffusers' under the same plan on every rank (torch.equal)
    - single_bit_exact: on one GPU alone, the fused output equals diffusers' (torch.equal)
    - fused_launches_per_rank: this package's kernel launches in one fused step, rank by rank
    - single_fused_launches: the same on one GPU alone
    - differs_from_single: elements of diffusers' output under the plan that differ from its
      single-GPU output (0: the plan changes no bit)
    - max_abs_diff_from_single: the largest of those differences (NaN when the shapes differ)
    - diffusers_sha256: SHA-256 of diffusers' output under the plan
    - fused_sha256: SHA-256 of the fused output under the plan
    - diffusers_profile: rank 0's kernels in one step under the plan, diffusers' forward (NCCL runs on
      its own stream, so the total may overlap compute)
    - fused_profile: the same with `enable()`
    """

    config: str
    plan: str
    backend: str
    world: int
    device: str
    batch: int
    img_tokens: int
    txt_tokens: int
    steps: int
    single_diffusers_ms: float
    single_fused_ms: float
    diffusers_ms: float
    fused_ms: float
    bit_exact: bool
    single_bit_exact: bool
    fused_launches_per_rank: list[int]
    single_fused_launches: int
    differs_from_single: int
    max_abs_diff_from_single: float
    diffusers_sha256: str
    fused_sha256: str
    diffusers_profile: Breakdown
    fused_profile: Breakdown

    @property
    def gain(self) -> float:
        """The fused step's speedup over diffusers under the plan."""
        return self.diffusers_ms / self.fused_ms

    @property
    def single_gain(self) -> float:
        return self.single_diffusers_ms / self.single_fused_ms

    @property
    def scaling(self) -> float:
        """The fused step under the plan against the fused step on one GPU."""
        return self.single_fused_ms / self.fused_ms


def format_parallel_table(result: ParallelResult, torch_version: str) -> str:
    """The parallel benchmark's table: one GPU, then the plan; each diffusers vs fused."""
    r = result
    headers = ["setup", "diffusers ms", "fused ms", "fused gain", "fused vs 1 GPU", "fused launches", "exact"]
    rows = [
        [
            "1 GPU",
            f"{r.single_diffusers_ms:.1f}",
            f"{r.single_fused_ms:.1f}",
            f"{r.single_gain:.3f}x",
            "1.00x",
            r.single_fused_launches,
            _yes(r.single_bit_exact),
        ],
        [
            f"{r.plan} ({r.world} GPUs)",
            f"{r.diffusers_ms:.1f}",
            f"{r.fused_ms:.1f}",
            f"{r.gain:.3f}x",
            f"{r.scaling:.2f}x",
            " / ".join(map(str, r.fused_launches_per_rank)),
            _yes(r.bit_exact),
        ],
    ]
    single = (
        "bit-identical to one GPU"
        if r.differs_from_single == 0
        else f"{r.differs_from_single} elements differ from 1 GPU (max {r.max_abs_diff_from_single:.3g})"
    )
    title = (
        f"{r.config}, {r.img_tokens}+{r.txt_tokens} tokens, batch {r.batch}, {r.backend} attention, "
        f"{r.steps} pipelined pairs, "
        f"{r.device}, torch {torch_version}; diffusers' output under the plan: {single}"
    )
    profile = markdown_table(
        ["rank 0 under the plan", "kernels", *_breakdown_headers()],
        [
            [mode, b.total_launches, *_breakdown_cells(b)]
            for mode, b in (("diffusers", r.diffusers_profile), ("fused", r.fused_profile))
        ],
    )
    return f"{title}\n{markdown_table(headers, rows)}\n\n{profile}"
