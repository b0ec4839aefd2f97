"""The kernel's module spec and its launcher: no validation, callers have guarded the inputs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import jit
from .reference import Segment

SPEC = jit.KernelSpec(
    "qk_norm_rope", sources=("qk_norm_rope.cu",), headers=("qk_norm_rope.cuh", "common.cuh", "entry.cuh")
)


def launch(rows: Sequence[Segment], cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """The joint rotated rows [B, sum S, H, head_dim], contiguous (the layout eager's RoPE returns,
    so attention sees the same strides), from one launch over one or two segments."""
    first = rows[0].x
    tokens = sum(segment.x.shape[1] for segment in rows)
    out = first.new_empty((first.shape[0], tokens, *first.shape[2:]))
    second = (rows[1].x, rows[1].weight) if len(rows) == 2 else (None, None)
    jit.module_for(SPEC, first.device).qk_norm_rope(out, first, rows[0].weight, *second, cos, sin, float(eps))
    return out
