"""The eager chain the float8 quantization kernel replaces, op for op as torchao 0.18 computes an
activation's float8 (`Float8Tensor.from_hp` on its torch path: `_choose_scale_float8`, then
`_quantize_affine_float8`), for e4m3fn and a scale a row ("row", `PerRow()`) or one for the tensor
("tensor", `PerTensor()`). docs/numerics.md (15) gives the arithmetic.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
GRANULARITIES = ("row", "tensor")


def scale(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """torchao's scale: the amax of |x| in x's dtype (over the last dim, or every dim), divided by 448
    in x's dtype, then to float32; [..., 1] a row, or all ones for the tensor."""
    dims = tuple(range(x.dim())) if granularity == "tensor" else (-1,)
    return (x.abs().amax(dim=dims, keepdim=True) / E4M3_MAX).to(torch.float32)


def quantize(x: torch.Tensor, granularity: str = "row") -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): x in float32 divided by its scale, clamped to +-448, cast to e4m3fn."""
    s = scale(x, granularity)
    q = (x.to(torch.float32) / s).clamp(min=-E4M3_MAX, max=E4M3_MAX).to(torch.float8_e4m3fn)
    return q, s
