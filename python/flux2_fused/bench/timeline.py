"""Where a pipelined step's GPU waits: the gaps between its kernels and what the host did before them.

    python -m flux2_fused.bench.timeline [--configs klein-4b] [--hosts package diffusers]
                                         [--size 1024x1024] [--steps 6] [--largest 12]

Why: the GPU's busy share of a pipelined step says how much of it the GPU spends idle, not why. An
idle gap is either the launch latency between two kernels the queue already holds (about a
microsecond or two on Hopper, in CUDA graphs too) or a wait for the host, which shows as a long gap
before a kernel that starts right after its launch call returns. This tool tells them apart:

- the host time to enqueue one step on an idle queue, against the step's GPU time (a host that
  needs less keeps ahead once it is);
- whether torch.profiler's start waits for the GPU (steps enqueued just before it are complete when
  it returns): if it does, a profile begins with the host's lead gone, so its first step is not a
  sustained one;
- from a profile of `--steps` pipelined fused steps (CPU activity and Python stacks recorded): the
  idle time, its share of the span, the gaps of 10 us or more, the kernels they precede, how soon
  after its launch call each such kernel started, and the longest host operations before the launch.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .options import (
    PX_PER_TOKEN,
    STEP_CONFIGS,
    add_configs_argument,
    image_size,
    no_package_model,
    tool_parser,
)
from .results.tables import markdown_table

# Chrome-trace categories: the GPU's work, the CUDA API calls that launch it, the host's operators.
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
HOST_CATEGORIES = ("python_function", "cpu_op")


@dataclass
class Gap:
    """An idle stretch of the GPU before a kernel: its length (us), the kernel after it, how long
    after its launch call returned that kernel started (us; None without the launch in the trace),
    and the longest host operations in the window before that launch (name, us)."""

    us: float
    kernel: str
    start_after_launch_us: float | None
    host_before: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class Timeline:
    """A traced run of pipelined steps: GPU activities, their span (ms), the idle time between them
    (ms and share of the span), and the gaps of `min_gap_us` or more (the largest first)."""

    activities: int
    span_ms: float
    idle_ms: float
    idle_pct: float
    min_gap_us: float
    gaps: list[Gap]

    def idle_before(self) -> list[tuple[str, float]]:
        """The long gaps' total (us) by the kernel after them, the most idle first."""
        total: Counter[str] = Counter()
        for gap in self.gaps:
            total[gap.kernel] += gap.us
        return total.most_common()


def analyze(events: Sequence[dict], min_gap_us: float = 10.0, host_window_us: float = 200.0) -> Timeline:
    """The Timeline of a Chrome trace's events (torch.profiler's `export_chrome_trace`: `ts` and
    `dur` in us, a kernel's and its launch call's `args.correlation` equal). A gap's host window is
    `host_window_us` plus the gap before the kernel's launch."""
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    if not gpu:
        return Timeline(0, 0.0, 0.0, 0.0, min_gap_us, [])
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES and e.get("dur", 0) > 0]
    idle, gaps, end = 0.0, [], gpu[0]["ts"] + gpu[0]["dur"]
    for event in gpu[1:]:
        gap = event["ts"] - end
        if gap > 0:
            idle += gap
            if gap >= min_gap_us:
                gaps.append(_gap(gap, event, launches, host, host_window_us))
        end = max(end, event["ts"] + event["dur"])
    span = end - gpu[0]["ts"]
    gaps.sort(key=lambda g: -g.us)
    return Timeline(len(gpu), span / 1e3, idle / 1e3, 100 * idle / span if span else 0.0, min_gap_us, gaps)


def _gap(us: float, kernel: dict, launches: dict, host: Iterable[dict], window_us: float) -> Gap:
    launch = launches.get(kernel.get("args", {}).get("correlation"))
    if launch is None:
        return Gap(us, kernel["name"], None)
    returned = launch["ts"] + launch.get("dur", 0)
    low = launch["ts"] - us - window_us
    # Host work that ran, start to end, in the window: not the frames that enclose the launch itself.
    before = sorted(
        (e for e in host if low <= e["ts"] and e["ts"] + e["dur"] <= launch["ts"] and e["dur"] >= 20),
        key=lambda e: -e["dur"],
    )
    return Gap(us, kernel["name"], kernel["ts"] - returned, [(e["name"], e["dur"]) for e in before[:6]])


def format_timeline(label: str, timeline: Timeline, largest: int) -> str:
    """The summary line, the idle before each kernel name, and the largest gaps with their host ops."""
    lines = [
        f"{label}: {timeline.activities} GPU activities over {timeline.span_ms:.1f} ms, idle "
        f"{timeline.idle_ms:.2f} ms ({timeline.idle_pct:.2f}%); gaps >= {timeline.min_gap_us:g} us: "
        f"{len(timeline.gaps)}, {sum(g.us for g in timeline.gaps) / 1e3:.2f} ms"
    ]
    if timeline.gaps:
        rows = [[name[:80], f"{us:.0f}"] for name, us in timeline.idle_before()[:8]]
        lines.append(markdown_table(["kernel after the gaps", "idle us"], rows))
    for gap in timeline.gaps[:largest]:
        after = "?" if gap.start_after_launch_us is None else f"{gap.start_after_launch_us:.0f}"
        lines.append(f"gap {gap.us:.0f} us before {gap.kernel[:70]!r}, started {after} us after its launch")
        lines += [f"    {name[:110]}: {us:.0f} us" for name, us in gap.host_before]
    return "\n".join(lines)


def enqueue_times(step: Callable[[], object], repeats: int = 3) -> list[tuple[float, float]]:
    """(host ms to enqueue `step` on an idle GPU, the step's GPU ms) for each of `repeats` steps."""
    import torch

    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        step()
        end.record()
        host_ms = (time.perf_counter() - began) * 1e3
        end.synchronize()
        times.append((host_ms, start.elapsed_time(end)))
    return times


def profiler_start_waits(step: Callable[[], object], steps: int = 3) -> tuple[bool, float]:
    """Whether `steps` steps enqueued just before torch.profiler starts are complete when its start
    returns (it waited for the GPU), and how long the start took (ms)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(steps):
        step()
    mark = torch.cuda.Event()
    mark.record()
    began = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]):
        done, took = mark.query(), (time.perf_counter() - began) * 1e3
        torch.cuda.synchronize()
    return done, took


def traced(step: Callable[[], object], steps: int) -> list[dict]:
    """The Chrome trace events of `steps` pipelined steps (after one untraced), host side included."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())["traceEvents"]


def run(config: str, host: str, size: tuple[int, int], steps: int, largest: int) -> str:
    """The report of one config on one host (see the module docstring)."""
    import functools

    import torch

    from .step import Subject

    width, height = size
    subject = Subject(config, host, None, "none", "none")
    tokens = (width // PX_PER_TOKEN) * (height // PX_PER_TOKEN)
    step = subject.runner(subject.inputs(1, tokens, 512, width // PX_PER_TOKEN))
    label = f"{config} on {host}, {width}x{height}"
    lines = []
    with torch.inference_mode():
        for fused in (False, True, True):  # warm-up; the first fused step self-checks
            step(fused)
        for fused in (False, True):
            subject.switch(fused)
            pairs = ", ".join(f"{h:.1f} / {g:.1f}" for h, g in enqueue_times(functools.partial(step, fused)))
            mode = "fused" if fused else "eager"
            lines.append(f"{label}, {mode}: host ms to enqueue a step / its GPU ms: {pairs}")
        done, took = profiler_start_waits(functools.partial(step, True))
        lines.append(
            f"torch.profiler's start took {took:.1f} ms; the steps enqueued before it were "
            + ("complete (it waited for the GPU)" if done else "not complete")
        )
        timeline = analyze(traced(functools.partial(step, True), steps))
    lines.append(format_timeline(f"{label}, {steps} pipelined fused steps", timeline, largest))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser("timeline", __doc__)
    add_configs_argument(parser, STEP_CONFIGS, ["klein-4b"])
    parser.add_argument(
        "--hosts", nargs="+", choices=("package", "diffusers"), default=["package", "diffusers"]
    )
    parser.add_argument("--size", type=image_size, default=(1024, 1024), metavar="WxH")
    parser.add_argument("--steps", type=int, default=6, help="pipelined fused steps traced (default 6)")
    parser.add_argument("--largest", type=int, default=12, help="gaps listed with their host ops")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.largest < 0:
        parser.error("--steps must be at least 1 and --largest at least 0")
    if "package" in args.hosts and (why := no_package_model(args.configs)) is not None:
        parser.error(f"{why}; run it with --hosts diffusers")
    import torch

    if not torch.cuda.is_available():
        parser.exit(2, "python -m flux2_fused.bench.timeline needs a CUDA GPU; none is visible\n")
    for config in args.configs:
        for host in args.hosts:
            print(run(config, host, args.size, args.steps, args.largest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
