"""The kernel's module spec and its launcher: no validation, callers have guarded the inputs."""

from __future__ import annotations

import torch

from .. import jit

SPEC = jit.KernelSpec(
    "swiglu", sources=("swiglu.cu",), headers=("swiglu.cuh", "rowwise.cuh", "common.cuh", "entry.cuh")
)
KERNEL = "swiglu_kernel"  # SPEC's __global__ function, by which profilers name it (ops.FUSED_KERNELS)


def launch(x: torch.Tensor, out: torch.Tensor | None, b: torch.Tensor | None = None) -> torch.Tensor:
    """silu(a) * b of x's rows (x = [a, b], or x = a beside the tensor b) into `out` (a [..., H] view,
    e.g. half of a wider buffer), or into a fresh contiguous tensor."""
    if out is None:
        out = x.new_empty((*x.shape[:-1], x.shape[-1] if b is not None else x.shape[-1] // 2))
    jit.module_for(SPEC, x.device).swiglu(out, x, b)
    return out
