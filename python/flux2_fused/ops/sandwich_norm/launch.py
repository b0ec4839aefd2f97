"""The kernel's module spec and its launcher: no validation, callers have guarded the inputs."""

from __future__ import annotations

import numpy as np
import torch

from .. import jit

SPEC = jit.KernelSpec(
    "sandwich_norm", sources=("sandwich_norm.cu",), headers=("sandwich_norm.cuh", "common.cuh", "entry.cuh")
)
KERNEL = "sandwich_norm_kernel"  # SPEC's __global__ function, by which profilers name it (ops.FUSED_KERNELS)


def mean_factor(rows: int, hidden: int) -> float:
    """aten's factor of a mean over the last dim of [rows, hidden]: float(rows) / numel, in float32
    (`mean_kernel_impl`), so the kernel multiplies by the very value aten does."""
    return float(np.float32(rows) / np.float32(rows * hidden))


def launch(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    scale: torch.Tensor | None = None,
    update: torch.Tensor | None = None,
    update_weight: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(out, stream) from one launch, as `reference.sandwich` returns them; fresh contiguous tensors
    (the stream is x itself without an update)."""
    out = None if weight is None else torch.empty_like(x)
    stream = x if update is None else torch.empty_like(x)
    module = jit.module_for(SPEC, x.device)
    rows = x.shape[0] * x.shape[1]
    factor = mean_factor(rows, x.shape[2])
    module.sandwich_norm(
        out,
        None if update is None else stream,
        x,
        update,
        weight,
        update_weight,
        gate,
        scale,
        float(eps),
        factor,
    )
    return out, stream
