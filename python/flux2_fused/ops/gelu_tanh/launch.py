"""The kernel's module spec and its launcher: no validation, callers have guarded the inputs."""

from __future__ import annotations

import torch

from .. import jit

SPEC = jit.KernelSpec(
    "gelu_tanh",
    sources=("gelu_tanh.cu",),
    headers=("gelu_tanh.cuh", "rowwise.cuh", "common.cuh", "entry.cuh"),
)
KERNEL = "gelu_tanh_kernel"  # SPEC's __global__ function, by which profilers name it (ops.FUSED_KERNELS)


def launch(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """gelu_tanh of x's rows into `out` (a view of x's shape, e.g. half of a wider buffer), or into a
    fresh contiguous tensor."""
    if out is None:
        out = x.new_empty(x.shape)
    jit.module_for(SPEC, x.device).gelu_tanh(out, x)
    return out
