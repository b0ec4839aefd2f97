"""The kernel's module spec and its launcher: no validation, callers have guarded the inputs."""

from __future__ import annotations

import numpy as np
import torch

from .. import jit

SPEC = jit.KernelSpec(
    "sandwich_norm",
    sources=("sandwich_norm.cu",),
    headers=("sandwich_norm.cuh", "float8_quant.cuh", "common.cuh", "entry.cuh"),
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
    return out, _run(out, None, x, weight, eps, scale, update, update_weight, gate)


def launch_quantized(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None = None,
    update: torch.Tensor | None = None,
    update_weight: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The quantizing form of `launch`: (q, q_scale, stream), q the e4m3fn bytes of torchao's per-row
    float8 of out (out's shape) and q_scale its float32 scale a row ([B, S, 1])."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    q_scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    return q, q_scale, _run(q, q_scale, x, weight, eps, scale, update, update_weight, gate)


def _run(
    out: torch.Tensor | None,
    q_scale: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    scale: torch.Tensor | None,
    update: torch.Tensor | None,
    update_weight: torch.Tensor | None,
    gate: torch.Tensor | None,
) -> torch.Tensor:
    """One launch into `out` (and `q_scale`: the quantizing form); returns the stream."""
    stream = x if update is None else torch.empty_like(x)
    module = jit.module_for(SPEC, x.device)
    rows = x.shape[0] * x.shape[1]
    factor = mean_factor(rows, x.shape[2])
    module.sandwich_norm(
        out,
        q_scale,
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
    return stream
