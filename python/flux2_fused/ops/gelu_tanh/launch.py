"""The kernel's module spec and its launcher: no validation, callers have guarded the inputs."""

from __future__ import annotations

import torch

from .. import jit
from ..rowwise import joint_outputs, quantized_outputs

SPEC = jit.KernelSpec(
    "gelu_tanh",
    sources=("gelu_tanh.cu",),
    headers=("gelu_tanh.cuh", "rowwise.cuh", "float8_quant.cuh", "common.cuh", "entry.cuh"),
)
KERNEL = "gelu_tanh_kernel"  # SPEC's __global__ function, by which profilers name it (ops.FUSED_KERNELS)


def launch(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """gelu_tanh of x's rows into `out` (a view of x's shape, e.g. half of a wider buffer), or into a
    fresh contiguous tensor."""
    if out is None:
        out = x.new_empty(x.shape)
    jit.module_for(SPEC, x.device).gelu_tanh(out, x)
    return out


def launch_quantized(
    x: torch.Tensor, prefix: torch.Tensor | None, b: None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows [prefix | gelu_tanh(x)] as torchao's per-row float8 (`RowOp.quantized`): fresh
    e4m3fn bytes and a float32 scale a row."""
    q, scale = quantized_outputs(x, x.shape[-1] + (0 if prefix is None else prefix.shape[-1]))
    jit.module_for(SPEC, x.device).gelu_tanh_quantized(q.view(torch.uint8), scale, prefix, x)
    return q, scale


def launch_joint(
    x: torch.Tensor, prefix: torch.Tensor | None, b: None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows [prefix | gelu_tanh(x)], fresh and contiguous, and each one's amax word (the joint
    form, `RowOp.quantized` per tensor)."""
    joint, words = joint_outputs(x, x.shape[-1] + (0 if prefix is None else prefix.shape[-1]))
    jit.module_for(SPEC, x.device).gelu_tanh_joint(joint, words, prefix, x)
    return joint, words
