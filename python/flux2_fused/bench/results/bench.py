"""`flux2-fused bench`: a denoise loop's two modes on one model, and its summary."""

from __future__ import annotations

from dataclasses import dataclass

from .tables import MODES, SITES, markdown_table, speedup_text, yes_no


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
            f"bit-exact: {yes_no(r.bit_exact)} (final latents of both modes, torch.equal and SHA-256)",
            f"  sha256 eager {r.eager.sha256}",
            f"  sha256 fused {r.fused.sha256}",
        ]
    )
