"""The live self-check: the float8 quantization kernels against eager (torchao's chain, `reference`)
on this device, once per dtype, granularity and process.

It feeds rows that break naive kernels: zero rows (a zero scale: every element NaN), rows of tiny
values whose scale underflows, denormals, rows at and past the e4m3 range (448, and elements whose
quotient rounds past it), NaN and +-Inf, a row that is one value, and rows of random bit patterns;
the whole-tensor scale sees the same rows, then a tensor with one NaN.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..bits import random_bits
from ..runtime import SUPPORTED_DTYPES, FusedOp
from . import reference
from .launch import SPEC, launch


@dataclass(frozen=True)
class Config:
    """What one self-check verdict covers, with the device and the torch version: the activation's
    dtype and the scale's granularity ("row" or "tensor")."""

    dtype: torch.dtype
    granularity: str = "row"

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} per {self.granularity}"


def same(got: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Equal bytes of q and equal bits of the scales (NaN payloads included: both come from the same
    GPU's arithmetic)."""
    (q, s), (eq, es) = got, expected
    return (
        q.shape == eq.shape
        and s.shape == es.shape
        and torch.equal(q.view(torch.uint8), eq.view(torch.uint8))
        and torch.equal(s.view(torch.int32), es.view(torch.int32))
    )


def edge_rows(x: torch.Tensor) -> None:
    """Rows 0-9 of [B, S, K] x (S >= 10) made into the edge cases the module docstring lists."""
    tiny = torch.finfo(x.dtype).tiny
    x[0, 0] = 0.0
    x[0, 1] *= tiny * 2.0**-4  # subnormal: the scale underflows to 0 in bf16 (fp16: denormals)
    x[0, 2] *= tiny
    x[0, 3, ::2] = 448.0
    x[0, 4] *= torch.finfo(x.dtype).max / 8
    x[0, 5, 3] = float("nan")
    x[0, 6, 5] = float("inf")
    x[0, 7, ::3] = -float("inf")
    x[0, 8] = -1.5
    x[0, 9] = torch.linspace(-1.0, 1.0, x.shape[-1], device=x.device).to(x.dtype) * 448.0


def self_check(device: torch.device, config: Config) -> tuple[bool, str]:
    """Compare the kernel with live eager for one dtype and granularity: (passed, what was compared)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))
    batch, tokens, cols = 2, 19, 520
    x = (torch.randn(batch, tokens, cols, generator=gen, device=device) * 3).to(config.dtype)
    edge_rows(x)
    clean = (torch.randn(batch, tokens, cols, generator=gen, device=device) * 3).to(config.dtype)
    cases = {
        "random and edge rows": x,
        "random bit patterns": random_bits((batch, tokens, cols), config.dtype, gen),
        "2-D rows": clean[0],
    }
    if config.granularity == "tensor":
        cases = {"random rows": clean, **cases}  # the others are NaN throughout with a tensor's scale
    for name, rows in cases.items():
        if not same(launch(rows, config.granularity), reference.quantize(rows, config.granularity)):
            return False, f"{name}: differs from eager"
    torch.cuda.synchronize(device)
    return True, f"{len(cases)} cases x [{batch}, {tokens}, {cols}] {config}, edge rows + random bits"


OP = FusedOp(
    name="float8_quant",
    spec=SPEC,
    self_check=self_check,
    verify_configs=tuple(
        Config(dtype, granularity) for dtype in SUPPORTED_DTYPES for granularity in reference.GRANULARITIES
    ),
)
