"""The live self-check: the swiglu kernel against eager on this device, once per dtype and process.

It feeds a dense [B, S, 2H] projection, the single block's layout (the MLP part of one wide
projection, written into the second half of a wider buffer), values across the whole range
(silu saturates at both ends, exp(-a) overflows for large negative a), NaN and +-Inf, and rows of
random bit patterns.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..bits import bits_equal, random_bits
from ..runtime import FusedOp
from . import reference
from .launch import SPEC, launch


@dataclass(frozen=True)
class Config:
    """What one self-check verdict covers, with the device and the torch version."""

    dtype: torch.dtype

    def __str__(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def self_check(device: torch.device, config: Config) -> tuple[bool, str]:
    """Compare the kernel with live eager for one dtype: (passed, what was compared)."""
    dtype = config.dtype
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))
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
    }
    for name, (rows, out) in cases.items():
        if not bits_equal(launch(rows, out), reference.swiglu(rows)):
            return False, f"{name}: differs from eager"
    torch.cuda.synchronize(device)
    return True, f"{len(cases)} cases x [{batch}, {tokens}, 2x{hidden}] {dtype}, edge values + random bits"


OP = FusedOp(
    name="swiglu",
    spec=SPEC,
    self_check=self_check,
    verify_configs=(Config(torch.bfloat16), Config(torch.float16)),
)
