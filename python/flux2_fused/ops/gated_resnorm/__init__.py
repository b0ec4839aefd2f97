"""gated_resnorm: `x = residual + gate * update`, then `(1 + scale) * layer_norm(x) + shift`, fused.

The entry points for models are `defer` and `apply`, and they make the site's whole decision: under a
torch.compile trace the site becomes the `torch.ops.flux2_fused` operators of `library` (which decide
when the graph runs); in eager mode the fused kernel runs where the guards prove it exact, else the
eager chain of `reference`, so every caller gets eager's bits by one decision written once. `defer`
leaves `residual + gate * update` (FLUX.3: `residual + gate * (update + update2)`) pending as a
`Segment` that carries its verdict, so the `apply` that consumes it checks only what the verdict did
not cover (the modulation of the norm). `fused` is the kernel decision without the fallback (None
where it declines), and the decline reasons say why a call is declined. `gated_resnorm` and
`modnorm` are the validated ops for direct use: they raise TypeError / ValueError for what the kernel
cannot take instead of falling back.

Modulation rows (gate, scale, shift) are one row for all tokens (FLUX.1/FLUX.2: [D], [1, D],
[B|1, 1, D]) or one per token (FLUX.3: [T, D], [B|1, T, D], e.g. chunks of a [B, T, 3D] tensor). A
site over two segments takes one scale and shift for all its rows, or (FLUX.3's single block) a
tuple with one per segment: each segment is then normalized and modulated with its own rows.

FLUX.3's per-token rows are each batch's first row in every run measured (a Linear of a time
embedding expanded over the tokens), which `uniform_rows` proves on the GPU: with such a proof
(`mod_rows` for scale and shift, a segment's `gate_rows` for its gate) the kernel reads each
batch's first row for every token where the proof's word says the rows are equal, the same bytes
from cache in place of three streamed rows a token.

`quantized` is the site's quantizing form for a torchao float8 Linear that reads only the norm's out
(per row): the kernel writes torchao's float8 of out (its bytes and a scale a row) in place of out,
which is never written; `quantized_reason` says why it declines.

`addcmul=True` is ComfyUI's modulation, `torch.addcmul(shift, norm, 1 + scale)`, whose product and
sum round once where diffusers rounds each (docs/numerics.md, 3.7); its kernels cover ComfyUI's
FLUX.2 sites (one modulation row a batch, no update or one, D up to 6144), and `addcmul_reason`
says why anything else runs the eager chain.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..uniform_rows import UniformRows
from . import guards, reference
from .guards import (
    ADDCMUL_MAX_DIM,
    MAX_DIM,
    SUPPORTED_DTYPES,
    addcmul_reason,
    defer_decline_reason,
    gated_resnorm_decline_reason,
    modnorm_decline_reason,
    quantized_form_reason,
    quantized_runtime_reason,
)
from .launch import KERNEL, NO_WORDS, Words, launch, launch_quantized
from .reference import ModulationRows, Segment
from .selfcheck import OP, ROW_MOD_MAX_DIM, Config, self_check

Result = tuple[torch.Tensor, torch.Tensor | None]
Modulation = reference.Modulation  # one tensor for all rows, or a tuple with one per segment


def _rows_reason(
    rows: Sequence[Segment], scale: Modulation, shift: Modulation, write_residual: bool
) -> str | None:
    """What one launch cannot do with these segments and this form of modulation, whatever their
    tensors. (The per-call path of every site: FLUX.1/FLUX.2's one segment pays two type checks.)"""
    if len(rows) not in (1, 2):
        return f"a launch takes one or two segments, got {len(rows)}"
    per_segment = type(scale) is tuple or type(shift) is tuple
    if per_segment:
        if not (type(scale) is tuple and type(shift) is tuple):
            return "scale and shift must both be tensors or both be tuples with one tensor per segment"
        if len(scale) != len(rows) or len(shift) != len(rows):
            return (
                f"per-segment scale and shift need one tensor per segment ({len(rows)}), "
                f"got {len(scale)} and {len(shift)}"
            )
    if len(rows) == 2:
        first, second = rows
        if first.gated != second.gated:
            return "the two segments mix gated and plain rows"
        if (first.update2 is None) != (second.update2 is None):
            return "the two segments mix one- and two-term updates"
        if not first.gated and write_residual:
            return "the kernel writes no concat of plain rows"
        shape, other = first.residual.shape, second.residual.shape
        if len(shape) != 3 or len(other) != 3:
            return "segments to concatenate must be [B, T, D]"
        if shape[0] != other[0]:
            return "the two segments differ in batch"
        if shape[2] != other[2] or first.residual.dtype != second.residual.dtype:
            # With a modulation each, no other check ties the segments together; eager's cat would
            # promote mixed dtypes, and the kernel reads both as the first's.
            return "the two segments differ in hidden size or dtype"
        if per_segment and shape[2] > ROW_MOD_MAX_DIM:
            return f"a modulation per segment takes D up to {ROW_MOD_MAX_DIM}, got {shape[2]}"
        if shape[1] == other[1] and not per_segment:
            # Eager modulates the concat, so per-token rows shared by the segments are rows of the
            # concat. Each segment's guard checks the modulation against its own rows, which declines
            # such rows unless both segments have exactly as many tokens as they have rows.
            for name, t in (("scale", scale), ("shift", shift)):
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-2] != 1:
                    return f"a per-token {name} shared by two segments (pass one per segment)"
    return None


def _word(proof: UniformRows | None, *views: torch.Tensor | None) -> torch.Tensor | None:
    """The proof's word for these views, None without a proof or where it does not cover them (a
    missing view included)."""
    return None if proof is None else proof.word(*views)


def _words(rows: Sequence[Segment], scale: Modulation, shift: Modulation, mod_rows: ModulationRows) -> Words:
    """The launch's uniform_rows words (`launch`'s `words`): each segment's gate's from its own
    proof, scale's and shift's from `mod_rows` (one proof for every row, or one a segment, as the
    modulation is given), each None where no proof covers the tensors."""
    first, second = rows[0], (rows[1] if len(rows) == 2 else None)
    if mod_rows is None and first.gate_rows is None and (second is None or second.gate_rows is None):
        return NO_WORDS  # every site but FLUX.3's
    gate0 = _word(first.gate_rows, first.gate)
    gate1 = None if second is None else _word(second.gate_rows, second.gate)
    if type(scale) is not tuple:  # one scale and shift: the second segment shares the first's word
        return gate0, _word(mod_rows if type(mod_rows) is not tuple else None, scale, shift), gate1, None
    proofs = mod_rows if type(mod_rows) is tuple and len(mod_rows) == len(scale) else (None,) * len(scale)
    mods = [_word(proof, sc, sh) for proof, sc, sh in zip(proofs, scale, shift, strict=True)]
    return gate0, mods[0], gate1, mods[1] if len(mods) == 2 else None


def _segment_reason(segment: Segment, scale: torch.Tensor, shift: torch.Tensor) -> str | None:
    if segment.update2 is not None:
        return gated_resnorm_decline_reason(
            segment.residual, segment.update, segment.gate, scale, shift, update2=segment.update2
        )
    if segment.gated:
        return gated_resnorm_decline_reason(segment.residual, segment.update, segment.gate, scale, shift)
    return modnorm_decline_reason(segment.residual, scale, shift)


def _accepted(segment: Segment, scale: torch.Tensor, shift: torch.Tensor) -> bool:
    """The guard for one segment of a launch, with its modulation."""
    if segment.update2 is None:
        if segment.deferred == "kernel" or segment.update is None:
            # A segment deferred with the kernel's verdict has its residual, update and gate accepted
            # already: the plain guard adds what the verdict could not see (scale and shift against
            # the residual, the runtime state), and together they are the gated guard.
            return guards.plain(segment.residual, scale, shift)
        return guards.gated(segment.residual, segment.update, segment.gate, scale, shift)
    if segment.deferred == "kernel" and segment.update is not None:
        return guards.plain(segment.residual, scale, shift)
    return guards.gated2(segment.residual, segment.update, segment.update2, segment.gate, scale, shift)


def _all_accepted(rows: Sequence[Segment], scale: Modulation, shift: Modulation) -> bool:
    """The guard of every segment of a launch, each with its modulation (its own, per segment)."""
    if type(scale) is tuple:
        return all(map(_accepted, rows, scale, shift))
    for segment in rows:
        # `_accepted`, its one-update branch inlined: FLUX.1/FLUX.2's sites pay no extra call.
        if segment.update2 is not None:
            accepted = _accepted(segment, scale, shift)
        elif segment.deferred == "kernel" or segment.update is None:
            accepted = guards.plain(segment.residual, scale, shift)
        else:
            accepted = guards.gated(segment.residual, segment.update, segment.gate, scale, shift)
        if not accepted:
            return False
    return True


def defer(
    residual: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor,
    *,
    update2: torch.Tensor | None = None,
    gate_rows: UniformRows | None = None,
    enabled: bool = True,
) -> Segment | torch.Tensor:
    """`residual + gate * update` (with update2: `residual + gate * (update + update2)`, each op
    rounded as eager rounds it), left pending for the next `apply` where that can consume it: a
    `Segment` carrying the verdict (under a torch.compile trace, or where the guard accepts) and
    the gate's proof `gate_rows`, else the eager sum. `enabled=False` (a model's switch) always
    computes the sum."""
    if enabled and torch.compiler.is_compiling():
        return Segment(residual, update, gate, "traced", update2=update2)
    if update2 is None:
        if enabled and guards.defer(residual, update, gate):
            return Segment(residual, update, gate, "kernel", gate_rows=gate_rows)
        return Segment(residual, update, gate).materialize()
    if enabled and guards.defer2(residual, update, update2, gate):
        return Segment(residual, update, gate, "kernel", update2=update2, gate_rows=gate_rows)
    return Segment(residual, update, gate, update2=update2).materialize()


def decline_reason(
    rows: Sequence[Segment],
    scale: Modulation,
    shift: Modulation,
    *,
    write_residual: bool = True,
    addcmul: bool = False,
) -> str | None:
    """Why `fused(rows, ..., addcmul=addcmul)` declines, or None when it launches the kernel."""
    reason = _rows_reason(rows, scale, shift, write_residual)
    if reason is None and addcmul:
        reason = addcmul_reason(rows, scale, shift)
    if reason is not None:
        return reason
    per_segment = type(scale) is tuple
    for i, segment in enumerate(rows):
        sc, sh = (scale[i], shift[i]) if per_segment else (scale, shift)
        reason = reason or _segment_reason(segment, sc, sh)
    return reason


def fused(
    rows: Sequence[Segment],
    scale: Modulation,
    shift: Modulation,
    eps: float,
    *,
    write_residual: bool,
    addcmul: bool = False,
    mod_rows: ModulationRows = None,
) -> Result | None:
    """(out, stream) from one kernel launch, or None where the guards decline.

    rows: one segment, or two whose rows are concatenated along tokens. scale and shift: one tensor
    for every row, or a tuple with one per segment; mod_rows their proofs of equal rows, in the same
    form (or None). stream is the site's rows as one tensor when write_residual (a single plain
    segment: its residual itself), else None.
    """
    try:
        if _rows_reason(rows, scale, shift, write_residual) is not None:
            return None
        if addcmul and addcmul_reason(rows, scale, shift) is not None:
            return None
    except Exception:  # not segments of tensors: declined, as the guards decline garbage
        return None
    if not _all_accepted(rows, scale, shift):
        return None
    words = _words(rows, scale, shift, mod_rows)
    if rows[0].update is None:
        out = launch(rows, scale, shift, eps, write_residual=False, addcmul=addcmul, words=words)[0]
        return out, rows[0].residual if write_residual else None
    return launch(rows, scale, shift, eps, write_residual=write_residual, addcmul=addcmul, words=words)


def apply(
    rows: Sequence[Segment],
    scale: Modulation,
    shift: Modulation,
    eps: float,
    *,
    write_residual: bool,
    enabled: bool = True,
    addcmul: bool = False,
    mod_rows: ModulationRows = None,
) -> Result:
    """(out, stream): the site's one decision. Under a torch.compile trace the `library` operators;
    else `fused` where it accepts, else the eager chain (`reference.segments`), bit for bit the same.
    scale and shift: one tensor for every row, or a tuple with one per segment (FLUX.3's single
    block: each segment normalized and modulated with its own rows, the outputs concatenated).
    stream is None where the kernel was told not to write it. `enabled=False` (a model's switch)
    always runs the eager chain. `addcmul=True` is ComfyUI's modulation, `addcmul(shift, norm,
    1 + scale)` with one rounding, where diffusers rounds the product and the sum apart. `mod_rows`:
    proofs that scale's and shift's per-token rows are each batch's first (`uniform_rows`), which
    only the kernel reads."""
    if enabled and torch.compiler.is_compiling():
        return _traced(rows, scale, shift, eps, addcmul)
    result = (
        fused(rows, scale, shift, eps, write_residual=write_residual, addcmul=addcmul, mod_rows=mod_rows)
        if enabled
        else None
    )
    return result if result is not None else reference.segments(rows, scale, shift, eps, addcmul=addcmul)


def quantized_reason(
    rows: Sequence[Segment], scale: Modulation, shift: Modulation, *, write_residual: bool = True
) -> str | None:
    """Why `quantized(rows, scale, shift, ..., write_residual=write_residual)` declines, or None when
    it launches the kernel, in `quantized`'s order of checks."""
    reason = _rows_reason(rows, scale, shift, write_residual) or quantized_form_reason(rows, scale, shift)
    reason = reason or decline_reason(rows, scale, shift, write_residual=write_residual)
    return reason or quantized_runtime_reason(rows[0].residual)


def quantized(
    rows: Sequence[Segment],
    scale: Modulation,
    shift: Modulation,
    eps: float,
    *,
    write_residual: bool,
    mod_rows: ModulationRows = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(q, scale, stream): the site's out as torchao's per-row float8 (e4m3fn bytes of out's shape,
    a float32 scale a row [..., 1]) and its stream as `fused` gives it, from one launch; None where
    the quantizing form declines (`quantized_reason`) or under a torch.compile trace (the caller
    then computes out, and the Linear quantizes it). `mod_rows` as `apply`'s."""
    if torch.compiler.is_compiling():
        return None
    try:
        if _rows_reason(rows, scale, shift, write_residual) or quantized_form_reason(rows, scale, shift):
            return None
    except Exception:  # not segments of tensors: declined, as the guards decline garbage
        return None
    if not _all_accepted(rows, scale, shift):
        return None
    if quantized_runtime_reason(rows[0].residual) is not None:
        return None
    words = _words(rows, scale, shift, mod_rows)
    if rows[0].update is None:
        q, q_scale, _ = launch_quantized(rows, scale, shift, eps, write_residual=False, words=words)
        return q, q_scale, rows[0].residual if write_residual else None
    return launch_quantized(rows, scale, shift, eps, write_residual=write_residual, words=words)


def _traced(
    rows: Sequence[Segment], scale: Modulation, shift: Modulation, eps: float, addcmul: bool
) -> Result:
    """(out, stream) through the operators, which decide when the compiled graph runs: one gated
    segment is the gated operator, a concat with one modulation its stream (concatenated) through the
    plain one, and per-segment modulation each segment through its own operator, the outputs
    concatenated (as eager concatenates FLUX.3's normalized segments)."""
    from . import library

    if reference.per_segment(rows, scale, shift):
        results = [
            _traced([segment], sc, sh, eps, addcmul)
            for segment, sc, sh in zip(rows, scale, shift, strict=True)
        ]
        if len(results) == 1:
            return results[0]
        return torch.cat([out for out, _ in results], dim=1), torch.cat([s for _, s in results], dim=1)
    if len(rows) == 1 and rows[0].gated:
        segment = rows[0]
        args = (segment.residual, segment.update, segment.gate, scale, shift, eps)
        return library.gated_resnorm(*args, segment.update2, addcmul)
    stream = reference.stream(rows)
    return library.modnorm(stream, scale, shift, eps, addcmul), stream


def gated_resnorm(
    residual: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float = 1e-6,
    *,
    update2: torch.Tensor | None = None,
    addcmul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on one gated site, without the self-check: fresh (out, residual_out), with update2
    the two-term update `residual + gate * (update + update2)`, with addcmul ComfyUI's modulation.

    Inputs are never modified. Unsupported inputs raise TypeError (types, dtypes, devices) or
    ValueError (shapes, strides, alignment, sizes) naming the problem.
    """
    if update2 is None:
        guards.gated.validate(residual, update, gate, scale, shift)
    else:
        guards.gated2.validate(residual, update, update2, gate, scale, shift)
    segment = Segment(residual, update, gate, update2=update2)
    _validate_addcmul([segment], scale, shift, addcmul)
    out, residual_out = launch([segment], scale, shift, eps, write_residual=True, addcmul=addcmul)
    assert residual_out is not None
    return out, residual_out


def modnorm(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6, *, addcmul: bool = False
) -> torch.Tensor:
    """The kernel's no-residual variant `(1 + scale) * layer_norm(x) + shift` (addcmul: ComfyUI's
    rounding), without the self-check; raises like `gated_resnorm`."""
    guards.plain.validate(x, scale, shift)
    _validate_addcmul([Segment(x)], scale, shift, addcmul)
    return launch([Segment(x)], scale, shift, eps, write_residual=False, addcmul=addcmul)[0]


def _validate_addcmul(rows: Sequence[Segment], scale: Modulation, shift: Modulation, addcmul: bool) -> None:
    reason = addcmul_reason(rows, scale, shift) if addcmul else None
    if reason is not None:
        raise ValueError(f"flux2-fused: {reason}")


gated_resnorm_reference = reference.gated_resnorm
modnorm_reference = reference.modnorm

__all__ = [
    "ADDCMUL_MAX_DIM",
    "KERNEL",
    "MAX_DIM",
    "OP",
    "ROW_MOD_MAX_DIM",
    "SUPPORTED_DTYPES",
    "Config",
    "Modulation",
    "ModulationRows",
    "Segment",
    "addcmul_reason",
    "apply",
    "decline_reason",
    "defer",
    "defer_decline_reason",
    "fused",
    "gated_resnorm",
    "gated_resnorm_decline_reason",
    "gated_resnorm_reference",
    "guards",
    "modnorm",
    "modnorm_decline_reason",
    "modnorm_reference",
    "quantized",
    "quantized_reason",
    "reference",
    "self_check",
]
