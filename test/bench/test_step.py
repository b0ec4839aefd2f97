"""CPU tests of the step benchmark's statistics; its CUDA timing runs on the device machine."""

from __future__ import annotations

import pytest

from flux2_fused.bench.report import Timing
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
