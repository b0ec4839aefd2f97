"""The kernels' module spec and their launcher: no validation, callers have guarded the inputs."""

from __future__ import annotations

import torch

from .. import jit

SPEC = jit.KernelSpec(
    "float8_quant", sources=("float8_quant.cu",), headers=("float8_quant.cuh", "common.cuh", "entry.cuh")
)
# SPEC's __global__ functions (the rows' kernel, and float8_quant_kernel_amax for a tensor's scale) share
# this prefix, by which profilers name them (ops.FUSED_KERNELS)
KERNEL = "float8_quant_kernel"
# The tensor's amax is reduced into a word a block of its first launch (at most 4 blocks an SM, and
# at most this many): no zeroing launch before it.
AMAX_WORDS = 1024


def launch(x: torch.Tensor, granularity: str = "row") -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) as `reference.quantize` returns them, fresh: a launch for a scale a row, two for the
    tensor's (its amax a block, then the rows, each block reducing those first)."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    per_tensor = granularity == "tensor"
    scale_shape = (1,) * x.dim() if per_tensor else (*x.shape[:-1], 1)
    scale = torch.empty(scale_shape, dtype=torch.float32, device=x.device)
    amax = torch.empty(AMAX_WORDS, dtype=torch.int32, device=x.device) if per_tensor else None
    jit.module_for(SPEC, x.device).float8_quant(q.view(torch.uint8), scale, x, amax)
    return q, scale
