"""The live self-check: the kernel against eager on this device, once per (D, dtype) and process.

The guards prove what metadata can; this proves the rest on the machine at hand (its GPU, driver,
compiler and torch build). It feeds what breaks naive kernels: constant rows (variance 0), huge and
tiny magnitudes, NaN and +-Inf, FLUX.2's strided per-batch modulation and broadcast rows, the plain
variant, and rows of random bit patterns in all five inputs (the packed pair math's equality with
eager rests on the hardware's rounding: docs/numerics.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..bits import bits_equal, random_bits
from ..runtime import FusedOp
from . import reference
from .launch import SPEC, launch
from .reference import Segment


@dataclass(frozen=True)
class Config:
    """What one self-check verdict covers, with the device and the torch version."""

    dim: int
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"D={self.dim} {str(self.dtype).removeprefix('torch.')}"


def _edge_rows(x: torch.Tensor, big: float, small: float) -> None:
    """Overwrite the first rows of a [B, T, D] input with the cases that break naive kernels."""
    dim = x.shape[-1]
    x[0, 0] = 0.375  # constant row: variance 0
    x[0, 1] *= big
    x[0, 2] *= small
    x[0, 3, 5 % dim] = float("nan")
    x[0, 4, 7 % dim] = float("inf")
    x[0, 5, ::2] = -float("inf")
    x[1, 0] = x[1, 0, 0]  # constant row in the second batch too


def self_check(device: torch.device, config: Config) -> tuple[bool, str]:
    """Compare the kernel with live eager for one configuration: (passed, what was compared)."""
    dim, dtype = config.dim, config.dtype
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))
    big, small = (3e4, 1e-4) if dtype == torch.float16 else (1e30, 1e-30)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    batch, tokens = 2, 37
    residual, update = randn(batch, tokens, dim), randn(batch, tokens, dim)
    _edge_rows(residual, big, small)
    update[0, 1] *= 1e3
    mod = randn(batch, 1, 6 * dim)
    shift, scale, gate = mod.chunk(6, dim=-1)[:3]  # FLUX.2's strided [B, 1, D] chunk views
    noise = [random_bits(shape, dtype, gen) for shape in [(batch, tokens, dim)] * 2 + [(batch, 1, dim)] * 3]
    cases = {
        "gated, per-batch modulation": (Segment(residual, update, gate), scale, shift),
        "gated, broadcast modulation": (Segment(residual, update, gate[:1, 0]), scale[0, 0], shift[:1, 0]),
        "no residual": (Segment(residual), scale, shift),
        "random bit patterns": (Segment(*noise[:3]), noise[3], noise[4]),
    }
    for name, (segment, sc, sh) in cases.items():
        out, residual_out = launch([segment], sc, sh, 1e-6, write_residual=segment.gated)
        ref_out, ref_stream = reference.segments([segment], sc, sh)
        if segment.gated and (residual_out is None or not bits_equal(residual_out, ref_stream)):
            return False, f"{name}: residual_out differs from eager"
        if not bits_equal(out, ref_out):
            return False, f"{name}: out differs from eager"
    torch.cuda.synchronize(device)
    return True, f"{len(cases)} cases x [{batch}, {tokens}, {dim}] {dtype}, random + edge rows + random bits"


VERIFY_DIMS = (3072, 4096, 6144, 8192, 16384, 4100)  # 4100 % 512 == 4: a partial last pass of the row
OP = FusedOp(
    name="gated_resnorm",
    spec=SPEC,
    self_check=self_check,
    verify_configs=tuple(
        Config(dim, dtype) for dim in VERIFY_DIMS for dtype in (torch.bfloat16, torch.float16)
    ),
)
