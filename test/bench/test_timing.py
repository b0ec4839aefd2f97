"""CPU tests of the benchmarks' shared timing helpers (their CUDA timing itself needs a GPU)."""

from __future__ import annotations

from flux2_fused.bench.timing import rotated_order


def test_the_modes_rotate_each_round() -> None:
    """Each round runs every mode once, starting one later than the round before."""
    order = rotated_order(["a", "b", "c"], 4)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
