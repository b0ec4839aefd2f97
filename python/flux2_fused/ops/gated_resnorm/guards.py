"""Why the gated_resnorm kernel cannot take a call: the checks, in words, and the boolean guards.

The kernel reproduces eager for [B, T, D] / [T, D] streams whose rows are dense (any batch stride),
modulation rows as eager broadcasts them over the stream: one row for all tokens ([D], [1, D],
[B|1, 1, D]: FLUX.1/FLUX.2) or one per token ([T, D], [B|1, T, D]: FLUX.3; D up to
ROW_MOD_MAX_DIM, the widths built), unit inner stride and batch and row strides that are multiples
of 4 elements; one 16-bit float dtype on one CUDA device, D a positive multiple of 4 up to MAX_DIM,
8-byte-aligned data, no autograd. Everything else declines: the caller then runs the eager chain
(`reference.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import runtime
from ..verdicts import Guard, Reason, TypeReason
from .reference import Modulation, Segment
from .selfcheck import OP, QUANTIZED_DIMS, ROW_MOD_MAX_DIM, Config

SUPPORTED_DTYPES = runtime.SUPPORTED_DTYPES
MAX_DIM = 16384  # the kernel's largest instantiation: 32 vectors of 4 per thread, 128 threads


def _stream_reason(name: str, t: Any, like: torch.Tensor | None) -> Reason:
    """Why a [B, T, D] / [T, D] stream tensor (residual, update or update2) cannot go to the kernel."""
    if not isinstance(t, torch.Tensor):
        return TypeReason(f"{name} is not a tensor")
    if t.dim() not in (2, 3):
        return f"{name} must be [B, T, D] or [T, D], got {tuple(t.shape)}"
    if like is not None and t.shape != like.shape:
        return f"{name} shape {tuple(t.shape)} differs from residual {tuple(like.shape)}"
    # Rows must be dense; a batch stride is free (the output norm reads image rows of the joint stream).
    if t.stride(-1) != 1 or (t.shape[-2] > 1 and t.stride(-2) != t.shape[-1]):
        return f"{name} is not contiguous along its rows (needs strides (..., D, 1))"
    if t.dim() == 3 and t.shape[0] > 1 and t.stride(0) % 4 != 0:
        return f"{name} batch stride {t.stride(0)} is not a multiple of 4 elements"
    return None


def _modulation_reason(name: str, t: Any, batch: int, tokens: int, dim: int) -> Reason:
    """Modulation rows as eager broadcasts them against a [B, T, D] / [T, D] stream, trailing axes
    aligned: [D]; [R, D] (R aligns with tokens, never with batches); [Bm, R, D]. R is 1 (one row for
    all tokens) or T (one per token), Bm is 1 or B: anything else would make eager broadcast the
    stream itself (a new output shape) or raise. Unit inner stride; batch and row strides in whole
    8-byte vectors, so that every row the kernel reads is as aligned as the data pointer."""
    if not isinstance(t, torch.Tensor):
        return TypeReason(f"{name} is not a tensor")
    shape = tuple(t.shape)
    if not 1 <= t.dim() <= 3:
        return f"{name} must be modulation rows [D], [T, D] or [B, T, D] (T: 1 or the tokens), got {shape}"
    rows = shape[0] if t.dim() == 3 else 1
    per_token = shape[-2] if t.dim() >= 2 else 1
    if shape[-1] != dim:
        return f"{name} has {shape[-1]} channels, residual has {dim}"
    if per_token not in (1, tokens):
        return f"{name} has {per_token} token rows for a stream of {tokens} (needs one, or one a token)"
    if per_token > 1 and dim > ROW_MOD_MAX_DIM:
        return f"{name} has a row per token, which the kernel takes for D up to {ROW_MOD_MAX_DIM}, got {dim}"
    if rows not in (1, batch):
        return f"{name} batch {shape[0]} does not match the stream batch {batch}"
    if t.stride(-1) != 1:
        return f"{name} has inner stride {t.stride(-1)} (needs 1)"
    if rows > 1 and t.stride(0) % 4 != 0:
        return f"{name} batch stride {t.stride(0)} is not a multiple of 4 elements"
    if per_token > 1 and t.stride(-2) % 4 != 0:
        return f"{name} row stride {t.stride(-2)} is not a multiple of 4 elements"
    return None


def _common_reason(tensors: Sequence[tuple[str, torch.Tensor]]) -> Reason:
    """Device, dtype and hidden-size checks shared by every guard."""
    first = tensors[0][1]
    if first.device.type != "cuda":
        return TypeReason(f"tensors are on {first.device}, the fused kernel needs CUDA")
    if first.dtype not in SUPPORTED_DTYPES:
        return TypeReason(f"dtype {first.dtype} is not supported (bfloat16, float16)")
    for name, t in tensors:
        if t.device != first.device:
            return TypeReason(f"{name} is on {t.device}, {tensors[0][0]} on {first.device}")
        if t.dtype != first.dtype:
            return TypeReason(f"{name} is {t.dtype}, {tensors[0][0]} is {first.dtype} (eager would promote)")
    dim = first.shape[-1]
    if dim <= 0 or dim % 4 != 0:
        return f"hidden size {dim} is not a positive multiple of 4 (aten would not vectorize)"
    if dim > MAX_DIM:
        return f"hidden size {dim} exceeds the kernel's maximum {MAX_DIM}"
    return None


def _metadata_reason(
    residual: Any, updates: Sequence[tuple[str, Any]], modulation: Sequence[tuple[str, Any]]
) -> Reason:
    """Everything the tensors' shapes, strides, dtypes and devices decide: the residual, the updates
    added to it (none for the no-residual variant, one or two for the gated add) and the modulation."""
    reason = _stream_reason("residual", residual, None)
    for name, t in updates:
        reason = reason or _stream_reason(name, t, residual)
    if reason is not None:
        return reason
    batch = residual.shape[0] if residual.dim() == 3 else 1
    tokens, dim = residual.shape[-2], residual.shape[-1]
    for name, t in modulation:
        reason = _modulation_reason(name, t, batch, tokens, dim)
        if reason is not None:
            return reason
    return _common_reason([("residual", residual), *updates, *modulation])


def _runtime_reason(residual: torch.Tensor, *_: Any) -> Reason:
    """Kill switch, kernel build and the self-check for this (device, D, dtype)."""
    return runtime.runtime_reason(OP, residual.device, Config(residual.shape[-1], residual.dtype))


gated = Guard(
    ("residual", "update", "gate", "scale", "shift"),
    lambda r, u, g, sc, sh: _metadata_reason(r, [("update", u)], [("gate", g), ("scale", sc), ("shift", sh)]),
    _runtime_reason,
)
defer = Guard(
    ("residual", "update", "gate"),
    lambda r, u, g: _metadata_reason(r, [("update", u)], [("gate", g)]),
    _runtime_reason,
)
plain = Guard(
    ("residual", "scale", "shift"),  # the plain variant's stream, named as its reasons name it
    lambda x, sc, sh: _metadata_reason(x, [], [("scale", sc), ("shift", sh)]),
    _runtime_reason,
)
# The two-term update `residual + gate * (update + update2)` (FLUX.3's blocks).
gated2 = Guard(
    ("residual", "update", "update2", "gate", "scale", "shift"),
    lambda r, u, v, g, sc, sh: _metadata_reason(
        r, [("update", u), ("update2", v)], [("gate", g), ("scale", sc), ("shift", sh)]
    ),
    _runtime_reason,
)
defer2 = Guard(
    ("residual", "update", "update2", "gate"),
    lambda r, u, v, g: _metadata_reason(r, [("update", u), ("update2", v)], [("gate", g)]),
    _runtime_reason,
)


def gated_resnorm_decline_reason(
    residual: Any, update: Any, gate: Any, scale: Any, shift: Any, *, update2: Any = None
) -> Reason:
    """Why the fused `gated_resnorm` declines these inputs (with update2: the two-term update), or
    None when it accepts them."""
    if update2 is not None:
        return gated2.reason(residual, update, update2, gate, scale, shift)
    return gated.reason(residual, update, gate, scale, shift)


def defer_decline_reason(residual: Any, update: Any, gate: Any, *, update2: Any = None) -> Reason:
    """Why `residual + gate * update` (with update2: `residual + gate * (update + update2)`) may not
    be left pending for a fused norm, or None."""
    if update2 is not None:
        return defer2.reason(residual, update, update2, gate)
    return defer.reason(residual, update, gate)


def modnorm_decline_reason(x: Any, scale: Any, shift: Any) -> Reason:
    """Why the fused `modnorm` (no residual) declines these inputs, or None when it accepts them."""
    return plain.reason(x, scale, shift)


# ComfyUI's modulation rounding (`addcmul=True`) is built for ComfyUI's FLUX.2 sites only: one scale
# and shift row a batch, one-term updates, D up to 6144 (its klein-4B, klein-9B and dev widths).
ADDCMUL_MAX_DIM = 6144


def addcmul_reason(rows: Sequence[Segment], scale: Modulation, shift: Modulation) -> str | None:
    """What the kernel's addcmul rounding (ComfyUI's) does not cover in these rows, or None: it is
    built for ComfyUI's FLUX.2 sites, one scale and shift for every row, one modulation row a batch,
    no update or one, D up to ADDCMUL_MAX_DIM."""
    form = "addcmul modulation"
    if type(scale) is tuple or type(shift) is tuple:
        return f"{form} takes one scale and shift for every row"
    if any(segment.update2 is not None for segment in rows):
        return f"{form} takes one-term updates"
    dim = rows[0].residual.shape[-1]
    if dim > ADDCMUL_MAX_DIM:
        return f"{form} takes D up to {ADDCMUL_MAX_DIM}, got {dim}"
    gates = [segment.gate for segment in rows if segment.gate is not None]
    if any(isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-2] != 1 for t in (scale, shift, *gates)):
        return f"{form} takes one modulation row a batch, not per-token rows"
    return None


def quantized_form_reason(rows: Sequence[Segment], scale: Modulation, shift: Modulation) -> str | None:
    """What the quantizing form (out as torchao's per-row float8) does not cover in these rows, or
    None: it is built for D of 3072, 4096 and 6144 (FLUX.1's, FLUX.2's and FLUX.3's widths) and for
    the update forms those sites have: one modulation row a batch with no update or one (FLUX.1,
    FLUX.2), rows per token or per segment with no update or a two-term one (FLUX.3)."""
    form = "the quantizing form"
    dim = rows[0].residual.shape[-1]
    if dim not in QUANTIZED_DIMS:
        return f"{form} takes D of {', '.join(map(str, QUANTIZED_DIMS))}, got {dim}"
    gates = [segment.gate for segment in rows if segment.gate is not None]
    per_token = type(scale) is tuple or any(
        isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-2] != 1 for t in (scale, shift, *gates)
    )
    two_terms = any(segment.update2 is not None for segment in rows)
    if rows[0].gated and per_token != two_terms:
        if per_token:
            return f"{form} takes a two-term update with modulation rows per token (FLUX.3's), not one"
        return f"{form} takes a two-term update with modulation rows per token only (FLUX.3's)"
    return None


def quantized_runtime_reason(residual: torch.Tensor) -> Reason:
    """Kill switch, kernel build and the quantizing form's self-check for this (device, D, dtype);
    its kernel is built for sm_89 and newer only."""
    config = Config(residual.shape[-1], residual.dtype, "row")
    return OP.unbuilt(residual.device, config) or runtime.runtime_reason(OP, residual.device, config)
