"""`flux2-fused bench --parallel`: one parallel plan against one GPU, and its table."""

from __future__ import annotations

from dataclasses import dataclass

from .tables import Breakdown, breakdown_cells, breakdown_headers, markdown_table, yes_no


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
            yes_no(r.single_bit_exact),
        ],
        [
            f"{r.plan} ({r.world} GPUs)",
            f"{r.diffusers_ms:.1f}",
            f"{r.fused_ms:.1f}",
            f"{r.gain:.3f}x",
            f"{r.scaling:.2f}x",
            " / ".join(map(str, r.fused_launches_per_rank)),
            yes_no(r.bit_exact),
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
        ["rank 0 under the plan", "kernels", *breakdown_headers()],
        [
            [mode, b.total_launches, *breakdown_cells(b)]
            for mode, b in (("diffusers", r.diffusers_profile), ("fused", r.fused_profile))
        ],
    )
    return f"{title}\n{markdown_table(headers, rows)}\n\n{profile}"
