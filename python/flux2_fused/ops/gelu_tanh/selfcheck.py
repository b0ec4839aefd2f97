"""The live self-check: the gelu_tanh kernel against eager on this device, once per dtype and process.

gelu_tanh is a unary elementwise function of a 16-bit input, so the check is exhaustive: every one of
the dtype's 65536 bit patterns (NaNs, +-Inf, subnormals and both zeros included) goes through the
kernel and through eager, as [2, 33, H] rows (a batch, an odd token count; the rows past the last
pattern hold random bits). Equality there is equality on the whole domain, for this GPU and torch
build: it settles what no argument about aten's compiled code can (the one contraction, tanhf;
docs/numerics.md). Two layout cases follow: FLUX.1's single block (a strided view in, the second half
of the [B, S, D + H] buffer the output projection reads out, H past one pass of the row loop) and
[S, H] rows.
"""

from __future__ import annotations

import os

import torch

from ..bits import every_bit_pattern, random_bits
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
        cases = quantizing_cases(device, dtype, gen, operands=1)
        return compare_quantized(device, cases, launch_quantized, launch_joint, reference.gelu_tanh, config)
    batch, tokens, hidden = 2, 33, 1000  # 66000 elements: room for every pattern
    every = random_bits((batch, tokens, hidden), dtype, gen)
    patterns = every_bit_pattern(dtype, device)
    every.view(-1)[: patterns.numel()] = patterns
    width, dim, mlp = 5000, 600, 4100  # 1025 vectors a row: a second pass of the row loop
    wide = random_bits((batch, 7, width), dtype, gen)
    joint = torch.empty(batch, 7, dim + mlp, device=device, dtype=dtype)
    cases = {
        f"every bit pattern ([{batch}, {tokens}, {hidden}])": (every, None),
        "strided rows into half of a wider buffer": (wide[..., width - mlp :], joint[..., dim:]),
        "[S, H] rows": (random_bits((tokens, 1028), dtype, gen), None),
    }
    return compare(
        device,
        cases,
        launch,
        reference.gelu_tanh,
        f"all {patterns.numel()} {dtype} bit patterns, strided rows into a buffer, [S, H] rows",
    )


OP = fused_op("gelu_tanh", SPEC, self_check)
