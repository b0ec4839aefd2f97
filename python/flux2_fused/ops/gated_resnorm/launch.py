"""The kernel's module spec and its launcher: no validation, callers have guarded the inputs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import jit
from .reference import Modulation, Segment

# uniform_rows words: (first segment's gate, first's scale and shift, second's gate, second's scale
# and shift), each an int32 [1] or None where the rows are not proven.
Words = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
NO_WORDS: Words = (None, None, None, None)

SPEC = jit.KernelSpec(
    "gated_resnorm",
    sources=("gated_resnorm.cu",),
    headers=("gated_resnorm.cuh", "float8_quant.cuh", "common.cuh", "entry.cuh"),
)
KERNEL = "gated_resnorm_kernel"  # SPEC's __global__ function, by which profilers name it (ops.FUSED_KERNELS)
_NO_SEGMENT = (None, None, None, None)  # the second segment's residual, update, update2, gate: absent


def launch(
    rows: Sequence[Segment],
    scale: Modulation,
    shift: Modulation,
    eps: float,
    *,
    write_residual: bool,
    addcmul: bool = False,
    words: Words = NO_WORDS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the kernel over one or two segments of rows (the second follows the first along tokens,
    both gated or both plain, both with one update or both with two); returns (out, residual_out),
    residual_out None unless write_residual, each shaped as eager's broadcasting would shape it.

    scale and shift: one tensor modulating every row of the launch (with per-token rows, the rows of
    the concat), or a tuple with one per segment, each modulating its own segment's rows. `addcmul`:
    the modulation rounds as aten's addcmul (ComfyUI's `apply_mod`), not as diffusers' chain.
    `words`: uniform_rows words of the segments' per-token rows (`Words`): where one is 0 the kernel
    reads each batch's first row for every token.

    The per-site hot path: the C++ entry reads [T, D] / [B, T, D] streams and the modulation rows
    the guards accept, [D] / [1|T, D] / [1|B, 1|T, D] (one row a batch or one for all, one row a
    token or one for all tokens), as given (no tensor views made here), and what is absent (the
    update of a plain segment, the second update, the second segment and its own modulation,
    residual_out) is passed as None rather than as a stand-in tensor.
    """
    gate, modulation, segments = _arguments(rows, scale, shift)
    out = _empty(rows, (*gate, *modulation[:2]))
    residual_out = _empty(rows, gate) if write_residual else None
    jit.module_for(SPEC, out.device).gated_resnorm(
        out, None, residual_out, *modulation, *segments, float(eps), bool(addcmul), *words
    )
    return out, residual_out


def launch_quantized(
    rows: Sequence[Segment],
    scale: Modulation,
    shift: Modulation,
    eps: float,
    *,
    write_residual: bool,
    words: Words = NO_WORDS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The quantizing form of `launch` (diffusers' rounding): (q, q_scale, residual_out), q the
    e4m3fn bytes of torchao's per-row float8 of out (out's shape) and q_scale its float32 scale a
    row ([..., 1]), as torchao's quantization of out would give them."""
    gate, modulation, segments = _arguments(rows, scale, shift)
    shape = _empty_shape(rows, (*gate, *modulation[:2]))
    device = rows[0].residual.device
    q = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
    q_scale = torch.empty((*shape[:-1], 1), dtype=torch.float32, device=device)
    residual_out = _empty(rows, gate) if write_residual else None
    jit.module_for(SPEC, device).gated_resnorm(
        q, q_scale, residual_out, *modulation, *segments, float(eps), False, *words
    )
    return q, q_scale, residual_out


def _arguments(
    rows: Sequence[Segment], scale: Modulation, shift: Modulation
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...], tuple[torch.Tensor | None, ...]]:
    """The first segment's gate where it has one (for the outputs' shapes); the entry's modulation
    arguments (scale, shift, scale1, shift1: the second segment's own, None where it shares the
    first's); and the segments' (residual, update, update2, gate), the second's None where absent."""
    first = rows[0]
    scale1 = shift1 = None
    if type(scale) is tuple:  # one per segment
        if len(rows) == 2:
            (scale, scale1), (shift, shift1) = scale, shift
        else:
            (scale,), (shift,) = scale, shift
    gate_rows = () if first.gate is None else (first.gate,)
    if len(rows) == 2:
        other = rows[1]
        second = (other.residual, other.update, other.update2, other.gate)
    else:
        second = _NO_SEGMENT
    segments = (first.residual, first.update, first.update2, first.gate, *second)
    return gate_rows, (scale, shift, scale1, shift1), segments


def _empty_shape(rows: Sequence[Segment], modulation: Sequence[torch.Tensor]) -> torch.Size:
    """The launch's output shape: eager's broadcast of the first segment's residual with the given
    modulation rows (`_eager_shape`), over the tokens of every segment."""
    r0 = rows[0].residual
    shape = _eager_shape(r0, *modulation)
    if len(rows) == 1:
        return shape
    tokens = sum(segment.residual.shape[-2] for segment in rows)
    return torch.Size((*shape[:-2], tokens, shape[-1]))


def _empty(rows: Sequence[Segment], modulation: Sequence[torch.Tensor]) -> torch.Tensor:
    """A fresh output of the launch's rows in the rows' dtype (`_empty_shape`)."""
    r0 = rows[0].residual
    shape = _empty_shape(rows, modulation)
    if len(rows) == 1 and len(shape) == r0.dim():  # the residual's own shape: the cheapest call
        return torch.empty_like(r0, memory_format=torch.contiguous_format)
    return r0.new_empty(shape)


def _eager_shape(stream: torch.Tensor, *modulation: torch.Tensor) -> torch.Size:
    """The shape eager broadcasting gives `stream` op'd with accepted modulation rows: a [T, D] stream
    with a [1, 1, D] or [1, T, D] row becomes [1, T, D]. (torch.broadcast_shapes costs more host time
    than the launch itself.)"""
    if stream.dim() == 2 and any(t.dim() == 3 for t in modulation):
        return torch.Size((1, *stream.shape))
    return stream.shape


def moved_bytes(args: Sequence[object]) -> int:
    """The bytes a launch with the entry's arguments (`launch`'s call) moves, for the benchmarks'
    traffic count: each tensor's elements once, but per-token modulation rows that a word of 0
    proves equal (the word read back here) once a batch, as the kernel reads them from cache."""
    tensors = [a if isinstance(a, torch.Tensor) else None for a in args]
    scale, shift, scale1, shift1 = tensors[3:7]
    gates = tensors[10], tensors[14]
    gate0_word, mod0_word, gate1_word, mod1_word = tensors[17:21]
    proven = {
        id(t)
        for word, group in (
            (gate0_word, (gates[0],)),
            (mod0_word, (scale, shift)),
            (gate1_word, (gates[1],)),
            (mod1_word, (scale1, shift1)),
        )
        if word is not None and int(word) == 0
        for t in group
        if t is not None and t.dim() >= 2
    }
    moved = 0
    for t in tensors[:17]:
        if t is not None:
            rows = t.shape[-2] if id(t) in proven else 1
            moved += t.numel() // rows * t.element_size()
    return moved
