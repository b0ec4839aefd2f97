"""Bit-level comparison and bit-pattern inputs, for self-checks, tests and benchmarks of every op."""

from __future__ import annotations

from collections.abc import Sequence

import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """t's bit patterns: a view of it as the integer dtype of its element size."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality that allows NaN payloads to differ but not NaN positions (`torch.equal` treats
    every NaN as unequal, and eager's NaN payloads are not part of the contract)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a_nan, b_nan = a.isnan(), b.isnan()
    if not torch.equal(a_nan, b_nan):
        return False
    return torch.equal(as_bits(a)[~a_nan], as_bits(b)[~b_nan])


def random_bits(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A 16-bit float tensor with every bit pattern equally likely: subnormals, NaN and Inf included."""
    raw = torch.randint(-(2**15), 2**15, tuple(shape), generator=gen, device=gen.device, dtype=torch.int32)
    return raw.to(torch.int16).view(dtype)


def every_bit_pattern(dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Each of the 65536 bit patterns of a 16-bit float dtype once, in int16 order: -0, the negative
    values by growing magnitude, -Inf and negative NaNs, then the same from +0. The whole domain of a
    unary op: equality with eager here is equality everywhere."""
    return torch.arange(-(2**15), 2**15, device=device, dtype=torch.int32).to(torch.int16).view(dtype)
