"""The live self-check: the uniform-rows kernel against its torch predicate on this device, once per
dtype and process.

A wrong "all rows equal" would have gated_resnorm read one row in place of another, so the cases
are the differences a naive comparison misses: one flipped bit in one element of one row (a random
one, and the last element of the last row), +0.0 against -0.0, NaNs of equal and of other payloads,
a batch whose rows equal another batch's first row but not its own, and a column view of a wider
tensor whose other columns differ (only the view's bytes count).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..bits import as_bits
from ..runtime import SUPPORTED_DTYPES, FusedOp
from . import reference
from .launch import SPEC, launch


@dataclass(frozen=True)
class Config:
    """What one self-check verdict covers, with the device and the torch version: the rows' dtype."""

    dtype: torch.dtype

    def __str__(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def _flipped(x: torch.Tensor, batch: int, row: int, col: int) -> torch.Tensor:
    """x with one bit of one element flipped (the lowest of its significand)."""
    y = x.clone()
    as_bits(y)[batch, row, col] ^= 1
    return y


def self_check(device: torch.device, config: Config) -> tuple[bool, str]:
    """Compare the kernel's word with the predicate's on each case: (passed, what was compared)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))
    batch, rows, width = 2, 37, 264  # odd rows; 264 elements: 33 vectors of 16 bytes (bf16)

    def uniform(cols: int) -> torch.Tensor:
        first = torch.randn(batch, 1, cols, generator=gen, device=device).to(config.dtype)
        return first.expand(batch, rows, cols).contiguous()

    def pick(n: int) -> int:
        return int(torch.randint(n, (1,), generator=gen, device=device))

    x = uniform(width)
    zeros = torch.zeros(batch, rows, width, device=device, dtype=config.dtype)
    signed = zeros.clone()
    signed[1, rows - 1, 5] = -0.0
    nans = uniform(width)
    nans[:, :, 3] = float("nan")
    other_nan = nans.clone()
    as_bits(other_nan)[0, 9, 3] ^= 1  # still a NaN, another payload
    crossed = x.clone()
    crossed[1, 1:] = x[0, 0]  # batch 1's rows equal batch 0's first row, not its own
    wide = uniform(3 * width)
    wide[:, 4, :width] += 1  # differs outside the view's columns only
    cases = {
        "equal rows": x,
        "one bit flipped in a random row": _flipped(x, pick(batch), 1 + pick(rows - 1), pick(width)),
        "one bit flipped in the last element": _flipped(x, batch - 1, rows - 1, width - 1),
        "+0.0 and -0.0": signed,
        "equal NaNs": nans,
        "NaNs of other payloads": other_nan,
        "another batch's first row": crossed,
        "a column view, other columns differing": wide[..., width : 2 * width],
        "2-D rows": x[0],
    }
    for name, rows_of in cases.items():
        if not torch.equal(launch(rows_of), reference.differs(rows_of)):
            return False, f"{name}: the word differs from the predicate's"
    torch.cuda.synchronize(device)
    return True, f"{len(cases)} cases x [{batch}, {rows}, {width}] {config}, flipped bits, signed zeros, NaNs"


OP = FusedOp(
    name="uniform_rows",
    spec=SPEC,
    self_check=self_check,
    verify_configs=tuple(Config(dtype) for dtype in SUPPORTED_DTYPES),
)
