"""Why the gelu_tanh kernel cannot take a call: the checks, in words, and the boolean guards.

The kernel reproduces eager for [B, S, H] / [S, H] row views with unit inner stride (rows and batch
possibly strided), H a positive multiple of 4, one 16-bit float dtype on one CUDA device,
8-byte-aligned rows and no autograd; `out` (when given) is a view of x's shape, over other rows (the
single block passes the second half of its output projection's input), that does not overlap x.
The checks are every row-wise op's (`ops/rowwise.py`), with x holding one operand.
"""

from __future__ import annotations

from typing import Any

from .. import runtime
from ..rowwise import RowGuards, overlap_reason
from ..verdicts import Reason
from .selfcheck import OP

SUPPORTED_DTYPES = runtime.SUPPORTED_DTYPES

rows = RowGuards(OP, operands=1, channels="a positive multiple of 4", out_shape="x's shape")
plain, into = rows.plain, rows.into


def decline_reason(x: Any, out: Any = None) -> Reason:
    """Why the fused gelu_tanh declines x (and the destination out), or None when it accepts them."""
    return rows.reason(x, out)


__all__ = ["SUPPORTED_DTYPES", "decline_reason", "into", "overlap_reason", "plain", "rows"]
