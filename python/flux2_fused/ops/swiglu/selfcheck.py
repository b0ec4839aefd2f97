"""The live self-check: the swiglu kernel against eager on this device, once per dtype and process.

It feeds a dense [B, S, 2H] projection, the single block's layout (the MLP part of one wide
projection, written into the second half of a wider buffer), a and b as two tensors (Z-Image's two
projections, one of them a strided view), values across the whole range
(silu saturates at both ends, exp(-a) overflows for large negative a), NaN and +-Inf, and rows of
random bit patterns.
"""

from __future__ import annotations

import os

import torch

from ..bits import random_bits
from ..rowwise import Config, compare, compare_quantized, fused_op, quantizing_cases
from . import reference
from .launch import SPEC, launch, launch_joint, launch_quantized


def self_check(device: torch.device, config: Config) -> tuple[bool, str]:
    """Compare the kernel (or the one with the quantizing epilogue) with live eager for one dtype:
    (passed, what was compared)."""
    dtype = config.dtype
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))
    if config.quantized:
        cases = quantizing_cases(device, dtype, gen, operands=2)
        return compare_quantized(device, cases, launch_quantized, launch_joint, reference.swiglu, config)
    batch, tokens, hidden = 2, 19, 200
    x = (torch.randn(batch, tokens, 2 * hidden, generator=gen, device=device) * 4).to(dtype)
    x[0, 0] = torch.linspace(-120, 120, 2 * hidden, device=device).to(dtype)  # both saturations
    x[0, 1] *= 1e-4
    x[0, 2, 3], x[0, 2, 5], x[0, 2, 7] = float("nan"), float("inf"), -float("inf")
    x[0, 2, hidden + 11] = float("inf")
    wide = torch.randn(batch, tokens, 3 * hidden + 2 * hidden, generator=gen, device=device).to(dtype)
    mlp = wide[..., 3 * hidden :]  # the single block's MLP part: a strided view
    buffer = torch.empty(batch, tokens, 2 * hidden, device=device, dtype=dtype)
    noise = random_bits((batch, tokens, 2 * hidden), dtype, gen)
    cases = {
        "dense projection": (x, None),
        "strided rows into half of a wider buffer": (mlp, buffer[..., hidden:]),
        "random bit patterns": (noise, None),
        "two projections": (x[..., :hidden].contiguous(), None, x[..., hidden:].contiguous()),
        "two projections, random bit patterns": (noise[..., hidden:], None, noise[..., :hidden]),
    }
    return compare(
        device,
        cases,
        launch,
        reference.swiglu,
        f"{len(cases)} cases x [{batch}, {tokens}, 2x{hidden}] {dtype}, edge values + random bits",
    )


OP = fused_op("swiglu", SPEC, self_check)
