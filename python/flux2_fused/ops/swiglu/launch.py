"""The kernel's module spec and its launcher: no validation, callers have guarded the inputs."""

from __future__ import annotations

import torch

from .. import jit
from ..rowwise import joint_outputs, quantized_outputs

SPEC = jit.KernelSpec(
    "swiglu",
    sources=("swiglu.cu",),
    headers=("swiglu.cuh", "rowwise.cuh", "float8_quant.cuh", "common.cuh", "entry.cuh"),
)
KERNEL = "swiglu_kernel"  # SPEC's __global__ function, by which profilers name it (ops.FUSED_KERNELS)


def launch(x: torch.Tensor, out: torch.Tensor | None, b: torch.Tensor | None = None) -> torch.Tensor:
    """silu(a) * b of x's rows (x = [a, b], or x = a beside the tensor b) into `out` (a [..., H] view,
    e.g. half of a wider buffer), or into a fresh contiguous tensor."""
    if out is None:
        out = x.new_empty((*x.shape[:-1], x.shape[-1] if b is not None else x.shape[-1] // 2))
    jit.module_for(SPEC, x.device).swiglu(out, x, b)
    return out


def launch_quantized(
    x: torch.Tensor, prefix: torch.Tensor | None, b: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows [prefix | silu(a) * b] as torchao's per-row float8 (`RowOp.quantized`): fresh
    e4m3fn bytes and a float32 scale a row."""
    hidden = x.shape[-1] if b is not None else x.shape[-1] // 2
    q, scale = quantized_outputs(x, hidden + (0 if prefix is None else prefix.shape[-1]))
    jit.module_for(SPEC, x.device).swiglu_quantized(q.view(torch.uint8), scale, prefix, x, b)
    return q, scale


def launch_joint(
    x: torch.Tensor, prefix: torch.Tensor | None, b: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows [prefix | silu(a) * b], fresh and contiguous, and each one's amax word (the joint
    form, `RowOp.quantized` per tensor)."""
    hidden = x.shape[-1] if b is not None else x.shape[-1] // 2
    joint, words = joint_outputs(x, hidden + (0 if prefix is None else prefix.shape[-1]))
    jit.module_for(SPEC, x.device).swiglu_joint(joint, words, prefix, x, b)
    return joint, words
