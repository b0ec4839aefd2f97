"""`flux2-fused pipeline`: whole pipeline calls per config, and their table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .tables import Timing, markdown_table, speedup_text, yes_no


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
                yes_no(r.images_equal),
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
