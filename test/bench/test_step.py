"""CPU tests of the step benchmark's statistics and of the GPU benchmarks' tables; their CUDA timing
needs a GPU."""

from __future__ import annotations

import pytest

from flux2_fused.bench.report import (
    KernelReport,
    KernelRow,
    StepResult,
    Timing,
    VerifyRow,
    format_kernel_table,
    format_step_table,
    format_verify,
)
from flux2_fused.bench.step import _pair_order


def test_pairs_alternate_which_mode_runs_first() -> None:
    assert _pair_order(3) == [False, True, True, False, False, True]


def test_timing_pairs_steps_by_position() -> None:
    eager, fused = [10.0, 12.0, 11.0, 30.0], [9.0, 12.5, 10.0, 29.0]
    t = Timing.of({False: eager, True: fused})
    assert (t.eager_ms, t.fused_ms) == (11.5, 11.25)
    assert t.speedup_pct == pytest.approx(100 * (11.5 / 11.25 - 1))
    assert t.paired_diff_ms == pytest.approx(0.625)  # mean of 1, -0.5, 1, 1
    assert t.paired_ci95_ms == pytest.approx(1.96 * 0.75 / 2)  # sample sd of the differences is 0.75
    assert t.fused_won == 3


def _table_widths(text: str) -> set[int]:
    """Cell counts of the markdown rows of `text` (one value when every row matches the header)."""
    return {line.count("|") for line in text.splitlines() if line.startswith("|")}


def test_the_gpu_benchmarks_tables_render_on_the_cpu() -> None:
    """The step, kernel and verify tables are printed only on a GPU: check them with made-up figures."""
    timing = Timing.of({False: [10.0, 12.0], True: [9.0, 11.0]})
    step = StepResult("klein-4b", 1, 2, 4096, 512, timing, timing, 1256, 1052, 41, "a" * 64, "a" * 64, True)
    table = format_step_table([step], "NVIDIA H200", "2.11.0")
    assert (
        _table_widths(table) == {14}
        and "| klein-4b | 1 | 4096+512 | pipelined | 11.00 | 10.00 | +10.0% |" in table
    )
    row = KernelRow(
        "gated_resnorm", 3072, 4096, 1, 184.0, 135.1, None, 80.0, 28.3, 23.8, 84.1, 2.3, 4.77, True
    )
    table = format_kernel_table(KernelReport("NVIDIA H200", "2.11.0", 4230.0, [row]))
    assert _table_widths(table) == {15} and "| gated_resnorm | 3072 | 4096 | 1 | 184.0 | 135.1 | - |" in table
    table = format_verify(
        [VerifyRow("gated_resnorm", "D=3072 bf16", False, "bit 3 differs", 0.1)], "H200", "2.11"
    )
    assert _table_widths(table) == {6} and table.endswith("1 of 1 FAILED")
