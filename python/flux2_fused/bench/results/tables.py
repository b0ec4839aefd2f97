"""What every command's report shares: the kernel classes and sites, the markdown table, the paired
timings, the kernel breakdown of a profiled step, and the JSON file."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
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


def yes_no(flag: bool) -> str:
    return "yes" if flag else "NO"


def speedup_text(pct: float | None) -> str:
    """A speedup for people: signed percent, or why there is none."""
    return INACTIVE if pct is None else f"{pct:+.1f}%"


def gain_text(diff_ms: float, ci95_ms: float) -> str:
    """A paired gain in ms and the half-width of its 95% confidence interval, as the step table prints
    each (eager vs fused, compiled vs fused)."""
    return f"{diff_ms:+.2f} +- {ci95_ms:.2f}"


def write_json(data: object, path: Path) -> None:
    """`data` (dataclasses already turned into dicts) as indented JSON."""
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


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


CLASS_LABELS = {
    "gemm": "GEMM",
    "attention": "attention",
    "fused": "fused",
    "collective": "NCCL",
    "other": "other",
}


def breakdown_cells(b: Breakdown) -> list[str]:
    """A breakdown's kernel ms (launches) by class, then the total kernel ms."""
    return [f"{b.kernel_ms[c]:.2f} ({b.launches[c]})" for c in KERNEL_CLASSES] + [f"{b.total_ms:.2f}"]


def breakdown_headers() -> list[str]:
    return [f"{CLASS_LABELS[c]} ms (launches)" for c in KERNEL_CLASSES] + ["total kernel ms"]
