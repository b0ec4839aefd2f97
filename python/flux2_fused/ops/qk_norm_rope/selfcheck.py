"""The live self-check: the kernel against eager on this device, once per dtype, mode and process.

It feeds both FLUX.2 layouts (a double block's q, k and v in two segments, q and k with their own
weights, dense [B, S, H*128] projections; a single block's q and k chunks of one wide projection, no
v), rows that break naive kernels (constant, all zero, huge, tiny, NaN, +-Inf), real RoPE tables, and
rows of random bit patterns in q, k, v, the weights and finite fp32 tables. The upcast mode (FLUX.3)
gets the same layouts and rows with float32 weights of full fp32 precision (random bit patterns:
any float32, subnormals, NaN and Inf included), and adds FLUX.3's own: one segment of q and k from
separate projections, no v. ComfyUI's rotations (`addcmul`, `kitchen`) add tables of one row a batch
element, as ComfyUI's rotation matrices come, and so does the complex rotation with diffusers' RMSNorm
(Z-Image's frequencies come one a batch element; Qwen-Image's are the double block's), whose tables
repeat each frequency for its channel pair as `reference.complex_tables` builds them.
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
    """What one self-check verdict covers, with the device and the torch version: the rows' dtype,
    the mode (`upcast`: FLUX.3's float32 norm and RoPE with a float32 weight), the host's RoPE
    arithmetic (`rotation`, `reference.ROTATIONS`) and its q/k norm (`norm`, `reference.NORMS`)."""

    dtype: torch.dtype
    upcast: bool = False
    rotation: str = "aten"
    norm: str = "fused"

    def __str__(self) -> str:
        return f"head_dim={HEAD_DIM} {str(self.dtype).removeprefix('torch.')}{_mode_words(self)}"


def _mode_words(config: Config) -> str:
    """The mode's words after the dtype: empty for FLUX.2's (aten's rotation and norm)."""
    words = [config.rotation] if config.rotation != "aten" else []
    words += [f"{config.norm} norm"] if config.norm != "fused" else []
    return (" upcast" if config.upcast else "") + "".join(f" {word}" for word in words)


def float32_bits(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A float32 tensor with every bit pattern equally likely: subnormals, NaN and Inf included."""
    raw = torch.randint(-(2**31), 2**31, shape, generator=gen, device=gen.device, dtype=torch.int64)
    return raw.to(torch.int32).view(torch.float32)


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
    """Compare the kernel with live eager for one dtype and mode: (passed, what was compared)."""
    dtype, upcast, rotation, norm = config.dtype, config.upcast, config.rotation, config.norm
    weight_dtype = torch.float32 if upcast else dtype
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))
    big, small = (3e2, 1e-3) if dtype == torch.float16 else (1e18, 1e-18)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    batch, heads, txt, img = 2, 3, 13, 29
    tokens = txt + img
    cos, sin = rope_tables(tokens, device, gen)

    def projection(rows: int) -> torch.Tensor:
        return randn(batch, rows, heads * HEAD_DIM).unflatten(-1, (heads, HEAD_DIM))

    def weight() -> torch.Tensor:  # upcast: float32 of full precision, so the unrounded products show
        return torch.randn(HEAD_DIM, generator=gen, device=device).to(weight_dtype)

    def weights() -> tuple[torch.Tensor, torch.Tensor]:
        return weight(), weight()

    q_txt, k_txt, v_txt, q_img, k_img, v_img = (projection(n) for n in (txt, txt, txt, img, img, img))
    for x in (q_img, k_txt, v_img):
        _edge_rows(x, big, small)
    (wq_txt, wq_img), (wk_txt, wk_img) = weights(), weights()
    wide = randn(batch, tokens, 5 * heads * HEAD_DIM)  # q, k, v and an MLP part, as the single block's
    q_joint, k_joint = (t.unflatten(-1, (heads, HEAD_DIM)) for t in wide.split(heads * HEAD_DIM, -1)[:2])
    _edge_rows(q_joint, big, small)
    _edge_rows(k_joint[:, 7:], big, small)
    noise = [random_bits((batch, tokens, heads, HEAD_DIM), dtype, gen) for _ in range(3)]
    if upcast:
        noise_weights = [float32_bits((HEAD_DIM,), gen) for _ in range(2)]
    else:
        noise_weights = [random_bits((HEAD_DIM,), dtype, gen) for _ in range(2)]
    finite = torch.rand(tokens, HEAD_DIM, generator=gen, device=device) * 2 - 1
    # down to float32's subnormals, which comfy-kitchen's rotation flushes
    exponents = torch.randint(-150, 60, (tokens, HEAD_DIM), generator=gen, device=device)
    noisy_table = torch.ldexp(finite, exponents.float()).float()
    if rotation == "complex":  # one frequency a channel pair, as `reference.complex_tables` lays them
        noisy_table[:, 1::2] = noisy_table[:, ::2]
    cases = {
        "double block: text + image segments of q, k, v": (
            [Segment(q_txt, wq_txt), Segment(q_img, wq_img)],
            [Segment(k_txt, wk_txt), Segment(k_img, wk_img)],
            cos,
            sin,
            [v_txt, v_img],
        ),
        "single block: strided q, k chunks of a wide projection": (
            [Segment(q_joint, wq_img)],
            [Segment(k_joint, wk_img)],
            cos,
            sin,
            None,
        ),
        "random bit patterns": (
            [Segment(noise[0], noise_weights[0])],
            [Segment(noise[1], noise_weights[1])],
            noisy_table,
            noisy_table.flip(0),
            [noise[2]],
        ),
    }
    if rotation != "aten":  # ComfyUI's tables (and Z-Image's frequencies) come one a batch row
        batched = [t[None].expand(batch, -1, -1).contiguous() for t in (cos, sin)]
        batched[1][1] = batched[1][1].flip(0)
        cases["one table a batch row"] = (
            [Segment(q_txt, wq_txt), Segment(q_img, wq_img)],
            [Segment(k_txt, wk_txt), Segment(k_img, wk_img)],
            *batched,
            [v_txt, v_img],
        )
    if upcast:  # FLUX.3: one segment of the joint rows, q and k from their own projections, no v
        q_one, k_one = projection(tokens), projection(tokens)
        _edge_rows(q_one, big, small)
        _edge_rows(k_one[:, 9:], big, small)
        cases["FLUX.3: one segment of q and k, no v"] = (
            [Segment(q_one, wq_txt)],
            [Segment(k_one, wk_txt)],
            cos,
            sin,
            None,
        )
    mode = {"upcast": upcast, "rotation": rotation, "norm": norm}
    for name, (q, k, c, s, v) in cases.items():
        got = launch(q, k, c, s, 1e-6, v, **mode)
        expected = reference.prologue(q, k, c, s, 1e-6, v, **mode)
        if not all(a is b or bits_equal(a, b) for a, b in zip(got, expected, strict=True)):
            return False, f"{name}: differs from eager"
    torch.cuda.synchronize(device)
    shape = f"[{batch}, {tokens}, {heads}, {HEAD_DIM}]"
    words = _mode_words(config).replace(" upcast", " upcast (float32 weights)", 1).strip()
    mode_words = f", {words}" if words else ""
    return True, f"{len(cases)} cases x {shape} {dtype}{mode_words}, edge rows + random bits"


OP = FusedOp(
    name="qk_norm_rope",
    spec=SPEC,
    self_check=self_check,
    verify_configs=tuple(
        Config(dtype, *mode)
        for mode in (
            (False, "aten", "fused"),
            (True, "aten", "fused"),
            (False, "addcmul", "fused"),
            (False, "kitchen", "fused"),
            (False, "complex", "mean"),
        )
        for dtype in (torch.bfloat16, torch.float16)
    ),
)
