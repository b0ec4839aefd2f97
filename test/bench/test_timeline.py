"""CPU tests of the timeline analysis (`bench.timeline`) on a made-up Chrome trace, and of its
command's argument checks; the traced steps themselves need a GPU."""

from __future__ import annotations

import pytest

from flux2_fused.bench.timeline import Gap, analyze, format_timeline, main

from . import one_line_error


def _kernel(name: str, ts: float, dur: float, correlation: int) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def _launch(ts: float, dur: float, correlation: int) -> dict:
    args = {"correlation": correlation}
    return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": dur, "args": args}


TRACE = [
    _kernel("gemm_a", 100.0, 50.0, 1),
    _kernel("gemm_b", 151.5, 48.5, 2),  # 1.5 us after gemm_a: a launch gap, not a wait
    _kernel("qk_norm_rope_kernel", 500.0, 20.0, 3),  # 300 us after gemm_b: the host was late
    _kernel("gemm_c", 520.0, 30.0, 4),  # back to back
    {"cat": "gpu_memset", "name": "Memset", "ts": 555.0, "dur": 5.0, "args": {"correlation": 5}},
    _launch(10.0, 5.0, 1),
    _launch(20.0, 5.0, 2),
    _launch(480.0, 8.0, 3),  # returned at 488: the kernel started 12 us later
    {"cat": "python_function", "name": "guards.py: accepts", "ts": 300.0, "dur": 150.0},
    {"cat": "cpu_op", "name": "aten::empty", "ts": 460.0, "dur": 5.0},  # too short to list
    {"cat": "cpu_op", "name": "aten::linear", "ts": 5.0, "dur": 40.0},  # before the window
]


def test_analyze_tells_launch_gaps_from_waits_on_the_host() -> None:
    timeline = analyze(TRACE, host_window_us=100.0)  # ops from 80 us (480 - 300 - 100) on
    assert timeline.activities == 5
    assert timeline.span_ms == pytest.approx(0.46)  # 100 us to 560 us
    assert timeline.idle_ms == pytest.approx((1.5 + 300.0 + 5.0) / 1e3)
    assert timeline.idle_pct == pytest.approx(100 * 306.5 / 460)
    assert timeline.gaps == [Gap(300.0, "qk_norm_rope_kernel", 12.0, [("guards.py: accepts", 150.0)])]
    assert timeline.idle_before() == [("qk_norm_rope_kernel", 300.0)]
    text = format_timeline("klein-4b", timeline, largest=5)
    assert "idle 0.31 ms (66.63%); gaps >= 10 us: 1, 0.30 ms" in text
    assert "gap 300 us before 'qk_norm_rope_kernel', started 12 us after its launch" in text
    assert "    guards.py: accepts: 150 us" in text


def test_analyze_without_launches_or_activities() -> None:
    timeline = analyze([e for e in TRACE if e["cat"] != "cuda_runtime"])
    assert timeline.gaps[0].start_after_launch_us is None and timeline.gaps[0].host_before == []
    assert "started ? us after" in format_timeline("x", timeline, largest=1)
    empty = analyze([])
    assert (empty.activities, empty.idle_pct, empty.gaps) == (0, 0.0, [])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps must be at least 1 and --largest at least 0"),
        (["--largest", "-1"], "--steps must be at least 1 and --largest at least 0"),
        (["--size", "1000x1000"], "argument --size: 1000x1000: 1000 is not a positive multiple of 16"),
        (["--configs", "klein"], "argument --config/--configs: invalid choice: 'klein'"),
        (["--configs", "flux1-dev"], "flux1-dev: FLUX.1 has no model of the package's own; run it with"),
    ],
)
def test_bad_arguments_are_one_line_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = one_line_error(main, argv, capsys)
    assert err.startswith(f"python -m flux2_fused.bench.timeline: error: {message}")


@pytest.mark.gpu
def test_a_timeline_on_the_gpu() -> None:
    """The package's klein-4B at 256x256: enqueue times, the profiler's start, a traced summary."""
    from flux2_fused.bench.timeline import run

    report = run("klein-4b", "package", (256, 256), steps=2, largest=2)
    assert "host ms to enqueue a step / its GPU ms" in report
    assert "torch.profiler's start took" in report
    assert "2 pipelined fused steps:" in report and "GPU activities over" in report
