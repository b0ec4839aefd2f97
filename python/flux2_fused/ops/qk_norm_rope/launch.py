"""The kernel's module spec and its launcher: no validation, callers have guarded the inputs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import jit
from .reference import NORMS, ROTATIONS, Segment

SPEC = jit.KernelSpec(
    "qk_norm_rope", sources=("qk_norm_rope.cu",), headers=("qk_norm_rope.cuh", "common.cuh", "entry.cuh")
)
KERNEL = "qk_norm_rope_kernel"  # SPEC's __global__ function, by which profilers name it (ops.FUSED_KERNELS)


def launch(
    q: Sequence[Segment],
    k: Sequence[Segment],
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    v: Sequence[torch.Tensor] | None = None,
    *,
    upcast: bool = False,
    rotation: str = "aten",
    norm: str = "fused",
    parts: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q, k, v) from one launch over one or two segments: each a joint [B, sum S, H, head_dim],
    contiguous (the layout eager's RoPE and concat return, so attention sees the same strides);
    v None when not given. `upcast`: FLUX.3's mode (float32 weights, the norm's output kept in fp32,
    one rounding at the end), else FLUX.2's; `rotation`: the host's RoPE arithmetic
    (`reference.ROTATIONS`); `norm`: its q/k norm (`reference.NORMS`); `parts`: the blocks a token
    takes (0: the kernel's choice from the grid's size, which tests override to cover each split)."""
    first = q[0].x
    shape = (first.shape[0], sum(segment.x.shape[1] for segment in q), *first.shape[2:])
    q_out, k_out = first.new_empty(shape), first.new_empty(shape)
    v_out = None if v is None else first.new_empty(shape)
    inputs = []
    for i in range(2):
        if i < len(q):
            inputs += [q[i].x, k[i].x, None if v is None else v[i], q[i].weight, k[i].weight]
        else:
            inputs += [None] * 5
    module = jit.module_for(SPEC, first.device)
    mode = (bool(upcast), ROTATIONS.index(rotation), NORMS.index(norm))
    module.qk_norm_rope(q_out, k_out, v_out, *inputs, cos, sin, float(eps), *mode, int(parts))
    return q_out, k_out, v_out
