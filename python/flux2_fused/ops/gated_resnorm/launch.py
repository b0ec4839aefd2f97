"""The kernel's module spec and its launcher: no validation, callers have guarded the inputs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import jit
from .reference import Segment

SPEC = jit.KernelSpec(
    "gated_resnorm", sources=("gated_resnorm.cu",), headers=("gated_resnorm.cuh", "common.cuh", "entry.cuh")
)
KERNEL = "gated_resnorm_kernel"  # SPEC's __global__ function, by which profilers name it (ops.FUSED_KERNELS)


def launch(
    rows: Sequence[Segment], scale: torch.Tensor, shift: torch.Tensor, eps: float, *, write_residual: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the kernel over one or two segments of rows (the second follows the first along tokens,
    both gated or both plain); returns (out, residual_out), residual_out None unless write_residual,
    each shaped as eager's broadcasting would shape it.

    The per-site hot path: the C++ entry reads [T, D] / [B, T, D] streams and the modulation rows
    the guards accept, [D] / [1, D] / [1|B, 1, D] (one row a batch or one for all, broadcast over
    tokens), as given (no tensor views made here), and what is absent (the update of a plain
    segment, the second segment, residual_out) is passed as None rather than as a stand-in tensor.
    """
    first = rows[0]
    r0 = first.residual
    gate_rows = () if first.gate is None else (first.gate,)

    def empty(*modulation: torch.Tensor) -> torch.Tensor:
        shape = _eager_shape(r0, *modulation)
        if len(rows) == 1 and len(shape) == r0.dim():  # the residual's own shape: the cheapest call
            return torch.empty_like(r0, memory_format=torch.contiguous_format)
        tokens = sum(segment.residual.shape[-2] for segment in rows)
        return r0.new_empty((*shape[:-2], tokens, shape[-1]))

    out = empty(*gate_rows, scale, shift)
    residual_out = empty(*gate_rows) if write_residual else None
    second = (rows[1].residual, rows[1].update, rows[1].gate) if len(rows) == 2 else (None, None, None)
    jit.module_for(SPEC, r0.device).gated_resnorm(
        out, residual_out, scale, shift, r0, first.update, first.gate, *second, float(eps)
    )
    return out, residual_out


def _eager_shape(stream: torch.Tensor, *modulation: torch.Tensor) -> torch.Size:
    """The shape eager broadcasting gives `stream` op'd with accepted modulation rows: a [T, D] stream
    with a [1, 1, D] row becomes [1, T, D]. (torch.broadcast_shapes costs more host time than the
    launch itself.)"""
    if stream.dim() == 2 and any(t.dim() == 3 for t in modulation):
        return torch.Size((1, *stream.shape))
    return stream.shape
