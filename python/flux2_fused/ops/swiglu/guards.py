"""Why the swiglu kernel cannot take a call: the checks, in words, and the boolean guards.

The kernel reproduces eager for [B, S, 2H] / [S, 2H] row views with unit inner stride (the single
block's MLP part is a strided view of one wide projection), H a positive multiple of 4, one 16-bit
float dtype on one CUDA device, 8-byte-aligned rows and no autograd; `out` (when given) is a
[..., H] view of the same rows that does not overlap x. With `b` (Z-Image's two projections) x is
[..., H] rows of a, and b rows of x's shape, dtype and device. The checks are every row-wise op's
(`ops/rowwise.py`), with x holding two operands, a and b.
"""

from __future__ import annotations

from typing import Any

from .. import runtime
from ..rowwise import RowGuards, overlap_reason
from ..verdicts import Reason
from .selfcheck import OP

SUPPORTED_DTYPES = runtime.SUPPORTED_DTYPES

rows = RowGuards(
    OP,
    operands=2,
    channels="2H with H a positive multiple of 4",
    out_shape="x's rows at half width",
)
plain, into, pair, pair_into = rows.plain, rows.into, rows.pair, rows.pair_into


def decline_reason(x: Any, out: Any = None, b: Any = None) -> Reason:
    """Why the fused swiglu declines x (with b, and the destination out), or None when it accepts
    them."""
    return rows.reason(x, out, b)


__all__ = [
    "SUPPORTED_DTYPES",
    "decline_reason",
    "into",
    "overlap_reason",
    "pair",
    "pair_into",
    "plain",
    "rows",
]
