"""The kernels' module spec and their launcher: no validation, callers have guarded the inputs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import jit

SPEC = jit.KernelSpec(
    "float8_quant", sources=("float8_quant.cu",), headers=("float8_quant.cuh", "common.cuh", "entry.cuh")
)
# SPEC's __global__ functions (the rows' kernel; float8_quant_kernel_amax and _tensor for a tensor's
# scale) share this prefix, by which profilers name them (ops.FUSED_KERNELS)
KERNEL = "float8_quant_kernel"
# The tensor's amax is reduced into a word a block of its first launch (at most 4 blocks an SM, and
# at most this many): no zeroing launch before it.
AMAX_WORDS = 1024


def launch(
    x: torch.Tensor, granularity: str = "row", words: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) as `reference.quantize` returns them, fresh: a launch for a scale a row; for the
    tensor's, a launch reducing its amax into a word a block, then one streaming x with the scale
    each block reduces from those words. `words` (per tensor): the amax words of x's rows that the
    kernel writing x left (a row-wise op's joint form), in place of the first launch."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    per_tensor = granularity == "tensor"
    scale_shape = (1,) * x.dim() if per_tensor else (*x.shape[:-1], 1)
    scale = torch.empty(scale_shape, dtype=torch.float32, device=x.device)
    given = 0 if words is None else words.numel()
    if per_tensor and words is None:
        words = torch.empty(AMAX_WORDS, dtype=torch.int32, device=x.device)
    jit.module_for(SPEC, x.device).float8_quant(
        q.view(torch.uint8), scale, x, words if per_tensor else None, given
    )
    return q, scale


def moved_bytes(args: Sequence[object]) -> int:
    """The bytes a launch with `launch`'s arguments moves, for the benchmarks' traffic count: each
    tensor's elements once, and x once more where the tensor's amax is reduced here (the first
    kernel reads x for it, the second again to quantize)."""
    q, scale, x, words, given = args
    moved = sum(t.numel() * t.element_size() for t in (q, scale, x, words) if isinstance(t, torch.Tensor))
    if words is not None and given == 0 and isinstance(x, torch.Tensor):
        moved += x.numel() * x.element_size()
    return moved
