"""The live self-check: the kernel against eager on this device, once per (D, dtype) and process.

The guards prove what metadata can; this proves the rest on the machine at hand (its GPU, driver,
compiler and torch build). It feeds what breaks naive kernels: constant rows (variance 0), huge and
tiny magnitudes, NaN and +-Inf, FLUX.2's strided per-batch modulation and broadcast rows, FLUX.3's
per-token modulation (chunks of a [B, T, 3D] tensor), its two-term update and its single block's
two segments with their own modulation, per-token rows proven equal (uniform_rows words of 0: the
kernel reads each batch's first row for every token), the plain variant, each with diffusers' and ComfyUI's
(addcmul) modulation rounding, and rows of random bit patterns in
every input (the packed pair math's equality with eager rests on the hardware's rounding:
docs/numerics.md).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch

from .. import runtime
from ..bits import bits_equal, random_bits
from ..runtime import FusedOp
from . import reference
from .launch import NO_WORDS, SPEC, Words, launch, launch_quantized
from .reference import Modulation, Segment

# A case: its segments, scale, shift and the uniform_rows words the launch gets.
Case = tuple[list[Segment], Modulation, Modulation, Words]


@dataclass(frozen=True)
class Config:
    """What one self-check verdict covers, with the device and the torch version: the kernel for a
    hidden size and dtype, or (`quantized="row"`) its quantizing form, out as torchao's per-row float8."""

    dim: int
    dtype: torch.dtype
    quantized: str | None = None

    def __str__(self) -> str:
        kind = f" quantized per {self.quantized}" if self.quantized else ""
        return f"D={self.dim} {str(self.dtype).removeprefix('torch.')}{kind}"


def _edge_rows(x: torch.Tensor, big: float, small: float) -> None:
    """Overwrite the first rows of a [B, T, D] input with the cases that break naive kernels."""
    dim = x.shape[-1]
    x[0, 0] = 0.375  # constant row: variance 0
    x[0, 1] *= big
    x[0, 2] *= small
    x[0, 3, 5 % dim] = float("nan")
    x[0, 4, 7 % dim] = float("inf")
    x[0, 5, ::2] = -float("inf")
    x[1, 0] = x[1, 0, 0]  # constant row in the second batch too


def self_check(device: torch.device, config: Config) -> tuple[bool, str]:
    """Compare the kernel with live eager for one configuration: (passed, what was compared)."""
    dim, dtype = config.dim, config.dtype
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))
    big, small = (3e4, 1e-4) if dtype == torch.float16 else (1e30, 1e-30)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    def stream(*shape: int) -> torch.Tensor:
        x = randn(*shape)
        _edge_rows(x, big, small)
        return x

    batch, tokens, text = 2, 37, 7  # odd token counts; FLUX.3's single block: 7 text + 37 image rows
    residual, update, update2 = (
        stream(batch, tokens, dim),
        randn(batch, tokens, dim),
        randn(batch, tokens, dim),
    )
    update[0, 1] *= 1e3
    update2[0, 2] *= 1e3
    mod = randn(batch, 1, 6 * dim)
    shift, scale, gate = mod.chunk(6, dim=-1)[:3]  # FLUX.2's strided [B, 1, D] chunk views
    # FLUX.3's per-token modulation: strided [B, T, D] chunk views of one [B, T, 3D] tensor, edge
    # rows included (a constant row, huge and tiny values, NaN and Inf in the modulation itself).
    t_shift, t_scale, t_gate = stream(batch, tokens, 3 * dim).chunk(3, dim=-1)
    txt_residual, txt_update, txt_update2 = (stream(batch, text, dim) for _ in range(3))
    c_shift, c_scale, c_gate = randn(batch, text, 3 * dim).chunk(3, dim=-1)
    noise = [random_bits((batch, tokens, dim), dtype, gen) for _ in range(6)]

    # FLUX.3's modulation as its model makes it: one row a batch (here an edge row, with a NaN) in
    # every token's row; the words say so (0), and the kernel reads each batch's first row.
    def uniform(rows: int, first: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return first.expand(batch, rows, 3 * dim).contiguous().chunk(3, dim=-1)

    u_shift, u_scale, u_gate = uniform(tokens, stream(batch, tokens, 3 * dim)[:, 3:4])
    uc_shift, uc_scale, uc_gate = uniform(text, randn(batch, 1, 3 * dim))
    equal = torch.zeros(1, dtype=torch.int32, device=device)
    cases: dict[str, tuple] = {
        "gated, per-batch modulation": ([Segment(residual, update, gate)], scale, shift),
        "gated, broadcast modulation": ([Segment(residual, update, gate[:1, 0])], scale[0, 0], shift[:1, 0]),
        "no residual": ([Segment(residual)], scale, shift),
        "gated, per-token modulation": ([Segment(residual, update, t_gate)], t_scale, t_shift),
        "two-term update, per-token modulation": (
            [Segment(residual, update, t_gate, update2=update2)],
            t_scale,
            t_shift,
        ),
        "no residual, per-token [T, D] modulation": ([Segment(residual)], t_scale[0], t_shift[1]),
        "two segments, two-term updates, per-segment modulation": (
            [
                Segment(txt_residual, txt_update, c_gate, update2=txt_update2),
                Segment(residual, update, t_gate, update2=update2),
            ],
            (c_scale, t_scale),
            (c_shift, t_shift),
        ),
        "two segments, one modulation": (
            [Segment(txt_residual, txt_update, gate), Segment(residual, update, gate[:1])],
            scale,
            shift,
        ),
        "random bit patterns": (
            [Segment(noise[0], noise[1], noise[2][:, :1])],
            noise[3][:, :1],
            noise[4][:1, :1],
        ),
        "random bit patterns, two-term update, per-token modulation": (
            [Segment(noise[0], noise[1], noise[2], update2=noise[3])],
            noise[4],
            noise[5],
        ),
        "two-term update, per-token rows proven equal": (
            [Segment(residual, update, u_gate, update2=update2)],
            u_scale,
            u_shift,
            (equal, equal, None, None),
        ),
        "no residual, per-token rows proven equal": (
            [Segment(residual)],
            u_scale,
            u_shift,
            (None, equal, None, None),
        ),
        "two segments, per-segment rows proven equal": (
            [
                Segment(txt_residual, txt_update, uc_gate, update2=txt_update2),
                Segment(residual, update, u_gate, update2=update2),
            ],
            (uc_scale, u_scale),
            (uc_shift, u_shift),
            (equal, equal, equal, equal),
        ),
    }
    full: dict[str, Case] = {
        name: case if len(case) == 4 else (*case, NO_WORDS)
        for name, case in cases.items()
        if dim <= ROW_MOD_MAX_DIM or not rows_per_token(*case[:3])
    }
    if config.quantized:
        return _check_quantized(device, full, (batch, tokens, dim, dtype))
    # Every case with diffusers' modulation, and those ComfyUI's rounding covers with it (aten's
    # addcmul: one rounding; one modulation row a batch, one-term updates, D <= 6144).
    from .guards import addcmul_reason  # the guards import this module's configurations

    checked = 0
    for (name, (rows, sc, sh, words)), addcmul in itertools.product(full.items(), (False, True)):
        if addcmul and addcmul_reason(rows, sc, sh) is not None:
            continue
        checked += 1
        gated = rows[0].gated
        out, residual_out = launch(rows, sc, sh, 1e-6, write_residual=gated, addcmul=addcmul, words=words)
        ref_out, ref_stream = reference.segments(rows, sc, sh, addcmul=addcmul)
        where = f"{name}{', addcmul' if addcmul else ''}"
        if gated and (residual_out is None or not bits_equal(residual_out, ref_stream)):
            return False, f"{where}: residual_out differs from eager"
        if not bits_equal(out, ref_out):
            return False, f"{where}: out differs from eager"
    torch.cuda.synchronize(device)
    return True, (
        f"{checked} cases x [{batch}, {tokens}, {dim}] {dtype} (per-batch, broadcast and per-token "
        "modulation, per-token rows proven equal, two-term updates, two segments, diffusers' and "
        "addcmul rounding), random + edge rows + random bits"
    )


def _check_quantized(device: torch.device, cases: dict[str, Case], shape: tuple) -> tuple[bool, str]:
    """The quantizing form's verdict over the cases it takes (`quantized_form_reason`: one
    modulation row a batch with no update or one, per-token or per-segment rows with no update or a
    two-term one, twin segments): its bytes and scales against torchao's quantization
    (`float8_quant.reference`, eager's kernels) of eager's out, and its stream against eager's."""
    from ..float8_quant import reference as float8_reference
    from ..float8_quant.selfcheck import same
    from .guards import quantized_form_reason  # the guards import this module's configurations

    checked = 0
    for name, (rows, sc, sh, words) in cases.items():
        if quantized_form_reason(rows, sc, sh) is not None:
            continue
        checked += 1
        gated = rows[0].gated
        q, q_scale, residual_out = launch_quantized(rows, sc, sh, 1e-6, write_residual=gated, words=words)
        ref_out, ref_stream = reference.segments(rows, sc, sh)
        if gated and (residual_out is None or not bits_equal(residual_out, ref_stream)):
            return False, f"{name}, quantized: residual_out differs from eager"
        if not same((q, q_scale), float8_reference.quantize(ref_out, "row")):
            return False, f"{name}: its quantization differs from torchao's of eager's out"
    torch.cuda.synchronize(device)
    batch, tokens, dim, dtype = shape
    return True, (
        f"{checked} quantizing cases x [{batch}, {tokens}, {dim}] {dtype} (per-batch and broadcast "
        "modulation with one update, per-token with two, proven equal or not, two segments), random + "
        "edge rows + random bits, against torchao's per-row float8"
    )


# 3072: FLUX.1, FLUX.2 klein-4B and FLUX.3 (24 heads x 128); 4096: klein-9B; 6144: FLUX.2 dev.
VERIFY_DIMS = (3072, 4096, 6144, 8192, 16384, 4100)  # 4100 % 512 == 4: a partial last pass of the row
# The quantizing form's hidden sizes (FLUX.1's, FLUX.2's and FLUX.3's): one instantiation each.
QUANTIZED_DIMS = (3072, 4096, 6144)
# Modulation rows per token or per segment (FLUX.3's) are built for D up to this (kRowModMaxVecs).
ROW_MOD_MAX_DIM = 6144


def rows_per_token(rows: list[Segment], scale: Modulation, shift: Modulation) -> bool:
    """Whether a launch reads modulation rows per token or per segment (the kernel's kRowMod)."""
    gates = [segment.gate for segment in rows if segment.gate is not None]
    if type(scale) is tuple and len(rows) == 2:
        return True
    return any(
        isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-2] != 1 for t in (scale, shift, *gates)
    )


OP = FusedOp(
    name="gated_resnorm",
    spec=SPEC,
    self_check=self_check,
    verify_configs=tuple(
        Config(dim, dtype) for dim in VERIFY_DIMS for dtype in (torch.bfloat16, torch.float16)
    )
    + tuple(Config(dim, dtype, "row") for dim in QUANTIZED_DIMS for dtype in (torch.bfloat16, torch.float16)),
    unbuilt=runtime.float8_unbuilt,
)
