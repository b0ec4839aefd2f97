"""The live self-check: the kernel against eager on this device, once per dtype and process.

It feeds both FLUX.2 layouts (a double block's two segments with their own weights, dense [B, S, H*128]
projections; a single block's q chunk of one wide projection), rows that break naive kernels
(constant, all zero, huge, tiny, NaN, +-Inf), real RoPE tables, and rows of random bit patterns in
x, the weight and finite fp32 tables.
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

HEAD_DIM = 128  # FLUX.2's head size; the kernel reproduces aten's reduction for this row length


@dataclass(frozen=True)
class Config:
    """What one self-check verdict covers, with the device and the torch version."""

    dtype: torch.dtype

    def __str__(self) -> str:
        return f"head_dim={HEAD_DIM} {str(self.dtype).removeprefix('torch.')}"


def rope_tables(tokens: int, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables [tokens, 128] as FLUX.2 builds them: angles repeated for each channel pair."""
    positions = torch.randint(0, 4096, (tokens, 1), generator=gen, device=device).double()
    inv_freq = 1.0 / (2000.0 ** (torch.arange(0, HEAD_DIM, 2, device=device).double() / HEAD_DIM))
    angles = positions * inv_freq
    return (
        angles.cos().repeat_interleave(2, dim=1).float(),
        angles.sin().repeat_interleave(2, dim=1).float(),
    )


def _edge_rows(x: torch.Tensor, big: float, small: float) -> None:
    """Overwrite the first heads of a [B, S, H, 128] input with what breaks naive kernels."""
    x[0, 0, 0] = 0.375  # constant head: every element equal
    x[0, 1, 0] = 0.0  # zero head: rsqrt(eps)
    x[0, 2, 0] *= big
    x[0, 3, 0] *= small
    x[0, 4, 0, 5] = float("nan")
    x[0, 5, 0, 7] = float("inf")
    x[0, 6, 0, ::2] = -float("inf")


def self_check(device: torch.device, config: Config) -> tuple[bool, str]:
    """Compare the kernel with live eager for one dtype: (passed, what was compared)."""
    dtype = config.dtype
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))
    big, small = (3e2, 1e-3) if dtype == torch.float16 else (1e18, 1e-18)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    batch, heads, txt, img = 2, 3, 13, 29
    tokens = txt + img
    cos, sin = rope_tables(tokens, device, gen)
    q_txt = randn(batch, txt, heads * HEAD_DIM).unflatten(-1, (heads, HEAD_DIM))
    q_img = randn(batch, img, heads * HEAD_DIM).unflatten(-1, (heads, HEAD_DIM))
    _edge_rows(q_img, big, small)
    w_txt, w_img = randn(HEAD_DIM), randn(HEAD_DIM)
    wide = randn(batch, tokens, 5 * heads * HEAD_DIM)  # q, k, v and an MLP part, as the single block's
    q_joint = wide[..., : heads * HEAD_DIM].unflatten(-1, (heads, HEAD_DIM))
    _edge_rows(q_joint, big, small)
    noise = random_bits((batch, tokens, heads, HEAD_DIM), dtype, gen)
    noise_weight = random_bits((HEAD_DIM,), dtype, gen)
    finite = torch.rand(tokens, HEAD_DIM, generator=gen, device=device) * 2 - 1
    exponents = torch.randint(-60, 60, (tokens, HEAD_DIM), generator=gen, device=device)
    noisy_table = torch.ldexp(finite, exponents.float()).float()
    cases = {
        "double block: text + image segments": ([Segment(q_txt, w_txt), Segment(q_img, w_img)], cos, sin),
        "single block: strided chunk of a wide projection": ([Segment(q_joint, w_img)], cos, sin),
        "random bit patterns": ([Segment(noise, noise_weight)], noisy_table, noisy_table.flip(0)),
    }
    for name, (rows, c, s) in cases.items():
        if not bits_equal(launch(rows, c, s, 1e-6), reference.qk_norm_rope(rows, c, s, 1e-6)):
            return False, f"{name}: differs from eager"
    torch.cuda.synchronize(device)
    shape = f"[{batch}, {tokens}, {heads}, {HEAD_DIM}]"
    return True, f"{len(cases)} cases x {shape} {dtype}, edge rows + random bits"


OP = FusedOp(
    name="qk_norm_rope",
    spec=SPEC,
    self_check=self_check,
    verify_configs=(Config(torch.bfloat16), Config(torch.float16)),
)
