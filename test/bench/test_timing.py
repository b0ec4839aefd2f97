"""CPU tests of the benchmarks' shared timing helpers (their CUDA timing itself needs a GPU)."""

from __future__ import annotations

import pytest

from flux2_fused.bench.timing import rotated_order, without_lead_ins


def test_the_modes_rotate_each_round() -> None:
    """Each round runs every mode once, starting one later than the round before."""
    order = rotated_order(["a", "b", "c"], 4)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]


def test_blocks_run_each_mode_in_a_row_after_its_lead_in() -> None:
    """With blocks, each mode runs its lead-in then `block` timed steps, the order still rotating;
    dropping the lead-ins leaves `block` times a mode a round, in order."""
    order = rotated_order(["a", "b"], 2, block=2, lead_in=1)
    assert order == ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3
    times = {"a": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], "b": [7.0, 8.0, 9.0, 10.0, 11.0, 12.0]}
    assert without_lead_ins(times, 2, 1) == {"a": [2.0, 3.0, 5.0, 6.0], "b": [8.0, 9.0, 11.0, 12.0]}
    assert without_lead_ins({"a": [1.0, 2.0, 3.0, 4.0]}, 1, 3) == {"a": [4.0]}
    assert without_lead_ins(times, 2, 0) is times
    assert rotated_order(["a", "b"], 1, block=2) == ["a", "a", "b", "b"]


class _Graph:
    """torch.cuda.CUDAGraph's part `graphed` uses, on the CPU: replays counted."""

    replays = 0

    def replay(self) -> None:
        self.replays += 1


def test_a_graph_keeps_what_it_captured_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """A captured graph holds only its tensors' addresses: the callable it captured (and every buffer
    the callable holds) must live as long as the graph, or replays write into freed memory. After the
    caller drops its callable, `graphed`'s result still holds it; replaying returns the captured
    output and replays the graph."""
    import contextlib
    import types
    import weakref

    from flux2_fused.bench import timing

    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    fake_cuda = types.SimpleNamespace(
        Stream=lambda: stream,
        current_stream=lambda: stream,
        stream=lambda s: contextlib.nullcontext(),
        CUDAGraph=_Graph,
        graph=lambda g: contextlib.nullcontext(),
    )
    monkeypatch.setattr(timing.torch, "cuda", fake_cuda)

    class Copy:
        """A captured step holding its own buffers, as the floor's replay and the kernel bench's copy do."""

        def __init__(self) -> None:
            self.buffers = [0] * 4
            self.calls = 0

        def __call__(self) -> str:
            self.calls += 1
            return "out"

    step = Copy()
    alive = weakref.ref(step)
    replay = timing.graphed(step)
    del step
    assert alive() is not None and alive().calls == 4  # three warm-up calls, one captured
    assert replay() == "out" and replay.graph.replays == 1 and alive().calls == 4
    del replay
    assert alive() is None
