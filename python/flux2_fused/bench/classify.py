"""The class of a profiled kernel (or aten op) by its name: one table for every benchmark.

`flux2-fused step` splits a step's CUDA kernels into GEMM, attention, fused, collective and other
(`results.tables.KERNEL_CLASSES`), `flux2-fused bench` a denoise step's kernels (on the CPU its aten ops)
into fused, norm, elementwise and other (`results.tables.SITES`). Both read this one table, each counting
the classes it does not report as other, so a kernel is never fused in one benchmark and something
else in the other, and a new op's kernel (`ops.FUSED_KERNELS`) is counted by both at once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from ..ops import FUSED_KERNELS, KERNEL_OPS

# The first pattern that matches a name gives its class, else "other". Fused comes first so our
# kernels are never counted as anything else, and attention before gemm because the memory-efficient
# SDPA kernels are CUTLASS kernels ("fmha_cutlassF_...").
_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("fused", re.compile("|".join(map(re.escape, FUSED_KERNELS)))),
    ("collective", re.compile(r"nccl", re.IGNORECASE)),
    ("attention", re.compile(r"flash|fmha|cudnn|attention|sdpa", re.IGNORECASE)),
    # gemv: cuBLAS's matrix-vector kernels, which a linear over a single row (batch 1) may run.
    ("gemm", re.compile(r"gemm|gemv|cutlass|xmma|nvjet|cublas", re.IGNORECASE)),
    ("norm", re.compile(r"layer_?norm|rms_?norm", re.IGNORECASE)),
    (
        "elementwise",
        re.compile(r"elementwise_kernel|^aten::(?:add|mul|sub|div|neg|silu|clamp|clip|cos|sin|exp|pow)_?$"),
    ),
)


def kernel_class(name: str, reported: Sequence[str]) -> str:
    """The class of a kernel or aten op by its name where `reported` (a benchmark's classes, "other"
    among them) holds it, else "other"."""
    cls = next((cls for cls, pattern in _PATTERNS if pattern.search(name)), "other")
    return cls if cls in reported else "other"


def tally(
    kernels: Iterable[tuple[str, float]], reported: Sequence[str]
) -> tuple[dict[str, float], dict[str, int]]:
    """(time in ms, count) by class of (name, duration in us) pairs, keyed by `reported` in its order;
    kept apart from the profiler so the split can be tested without a GPU."""
    ms, counts = dict.fromkeys(reported, 0.0), dict.fromkeys(reported, 0)
    for name, us in kernels:
        cls = kernel_class(name, reported)
        ms[cls] += us / 1e3
        counts[cls] += 1
    return ms, counts


def fused_op(name: str) -> str | None:
    """The op (`ops.KERNEL_OPS`) whose kernel a profiled kernel of this name is, else None: how a
    step's fused kernel time is split by op."""
    return next((op for kernel, op in KERNEL_OPS.items() if kernel in name), None)
