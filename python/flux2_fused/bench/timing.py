"""GPU timing helpers shared by the benchmarks: CUDA-event medians and the copy-bandwidth ceiling."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

T = TypeVar("T")
K = TypeVar("K")


def event_ms(fn: Callable[[], T]) -> tuple[T, float]:
    """(fn(), its time in ms between CUDA events around it on the current stream), waited for, so
    the host's lead over the GPU is not counted."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end)


def median_us(fn: Callable[[], object], *, warmup: int = 10, reps: int = 50) -> float:
    """Median wall time of `fn` on the current stream, in microseconds, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(event_ms(fn)[1] * 1e3 for _ in range(reps))


def interleaved_median_us(
    fns: Sequence[Callable[[], object]], *, warmup: int = 10, reps: int = 50
) -> list[float]:
    """Medians of several variants timed in alternation, so clock and thermal drift hit all alike."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            samples[i].append(event_ms(fn)[1] * 1e3)
    return [statistics.median(s) for s in samples]


def rotated_order(names: Sequence[K], rounds: int, block: int = 1, lead_in: int = 0) -> list[K]:
    """Every name once a round, the order rotated by one each round, so drift hits all alike; each
    name runs `lead_in` + `block` steps in a row (`without_lead_ins` drops the lead-ins' times)."""
    rotated = (names[(r + i) % len(names)] for r in range(rounds) for i in range(len(names)))
    return [name for name in rotated for _ in range(lead_in + block)]


def without_lead_ins(times: dict[K, list[float]], block: int, lead_in: int) -> dict[K, list[float]]:
    """The times of `pipelined_ms` over a `rotated_order(..., block, lead_in)`, each block's lead-in
    dropped.

    Why: at the GPU's power cap the clock a step runs at follows the load of the seconds before it
    (an eager step's elementwise kernels leave the clock high for what follows; GEMMs alone settle
    it lower than a fused step's mix does), so a step timed right after another mode carries that
    mode's clock. A lead-in long enough for the clock to settle times each mode at its own steady
    clock, as a denoise loop runs one mode for all its steps."""
    if lead_in == 0:
        return times
    period = lead_in + block
    return {mode: [t for j, t in enumerate(ts) if j % period >= lead_in] for mode, ts in times.items()}


def pipelined_ms(run: Callable[[K], object], order: Sequence[K]) -> dict[K, list[float]]:
    """Steps enqueued back to back, as a denoise loop enqueues them (diffusers' pipelines do not
    synchronize between steps): `run(mode)` for each mode of `order`, after one untimed lead-in of
    the first (the host gets ahead of the GPU before the first timed step), each step timed between
    the CUDA events around it, one synchronization at the end. Once the host runs ahead this is the
    step's GPU time, launch gaps included. The times by mode, in order."""
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(order) + 1)]
    run(order[0])
    marks[0].record()
    for mode, mark in zip(order, marks[1:], strict=True):
        run(mode)
        mark.record()
    marks[-1].synchronize()
    times: dict[K, list[float]] = {mode: [] for mode in order}
    for mode, start, end in zip(order, marks, marks[1:], strict=False):
        times[mode].append(start.elapsed_time(end))
    return times


class Graphed(Generic[T]):
    """A callable captured in a CUDA graph: calling it replays the graph and returns the last captured
    call's output. It keeps the callable alive as long as itself, and with it every tensor outside the
    graph's pool that the captured kernels read or write (a floor's held arguments, a copy's buffers):
    the graph holds only their addresses, and memory freed under it would be handed to other tensors
    (or back to the driver) while replays still write there."""

    def __init__(self, graph: torch.cuda.CUDAGraph, out: T, captured: Callable[[], T]) -> None:
        self.graph = graph
        self.out = out
        self.captured = captured

    def __call__(self) -> T:
        self.graph.replay()
        return self.out


def graphed(fn: Callable[[], T], repeats: int = 1) -> Graphed[T]:
    """`fn` captured `repeats` times in one CUDA graph, after warm-up calls on a side stream (as
    capture requires); the returned callable replays the graph and returns the last captured call's
    output, which every replay overwrites, and keeps `fn` alive (`Graphed`).

    Time a replay and divide by `repeats` for the per-call GPU time without launch gaps: one capture
    per call would still pay the graph launch itself, which dwarfs a 10 us kernel.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            out = fn()

    return Graphed(graph, out, fn)


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src), warmup=5, reps=20)
    return 2 * nbytes / (us * 1e-6) / 1e9
