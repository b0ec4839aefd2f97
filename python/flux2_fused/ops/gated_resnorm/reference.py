"""The eager chains the kernel replaces: the contract, op for op as FLUX.1, FLUX.2 and FLUX.3 (diffusers)
write them.

Whatever the fused path declines runs these, so a declined call gives the same bits by the same
code. The arithmetic each aten op performs, and why the kernel reproduces it, is in
docs/numerics.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..uniform_rows import UniformRows


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows of a residual stream: `residual + gate * update`, `residual + gate * (update + update2)`
    (FLUX.3's blocks), or `residual` alone without an update.

    residual, update and update2 are [B, T, D] (or [T, D]); gate is modulation rows as eager
    broadcasts them against the residual: one row for all tokens ([D], [1, D], [B|1, 1, D]) or one
    per token ([T, D], [B|1, T, D]). A site's input is one segment, or two whose rows follow each
    other along tokens (a concat).
    """

    residual: torch.Tensor
    update: torch.Tensor | None = None
    gate: torch.Tensor | None = None
    # The verdict a gated segment was left pending with (`gated_resnorm.defer`): "kernel" when the
    # guard accepted its residual, update(s) and gate, "traced" when a torch.compile trace left it for
    # the graph's operator; None for a segment nobody has judged.
    deferred: str | None = None
    # A second update added to the first before the gate multiplies them (keyword only, so the
    # positional form of FLUX.1/FLUX.2's segments is unchanged).
    update2: torch.Tensor | None = field(default=None, kw_only=True)
    # A proof that the gate's per-token rows are each batch's first (FLUX.3's), which the kernel may
    # then read for every token; the eager chain has no use for it.
    gate_rows: UniformRows | None = field(default=None, kw_only=True)

    @property
    def gated(self) -> bool:
        return self.update is not None

    def materialize(self) -> torch.Tensor:
        """The rows as eager computes them: each elementwise op rounded to the stream dtype (two ops,
        three with update2: the sum of the updates is rounded before the gate multiplies it)."""
        if self.update2 is not None:
            return self.residual + self.gate * (self.update + self.update2)
        if self.update is None:
            return self.residual
        return self.residual + self.gate * self.update

    def rows(self, start: int) -> Segment:
        """The same rows restricted to tokens [start:] (views; nothing is computed)."""
        update = None if self.update is None else self.update[..., start:, :]
        update2 = None if self.update2 is None else self.update2[..., start:, :]
        gate = self.gate
        if gate is not None and gate.dim() >= 2 and gate.shape[-2] != 1:  # per-token rows
            gate = gate[..., start:, :]
        return Segment(
            self.residual[..., start:, :],
            update,
            gate,
            self.deferred,
            update2=update2,
            gate_rows=self.gate_rows,
        )


# A site's scale or shift: one tensor for all its rows, or a tuple with one tensor per segment.
Modulation = torch.Tensor | tuple[torch.Tensor, ...]
# Proofs that scale's and shift's per-token rows are each batch's first, in the same form: one for
# every row, or a tuple with one (or None) per segment.
ModulationRows = UniformRows | tuple[UniformRows | None, ...] | None


def modnorm(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6, addcmul: bool = False
) -> torch.Tensor:
    """`(1 + scale) * layer_norm(x) + shift`, LayerNorm without affine, as eager computes it; with
    `addcmul`, ComfyUI's `apply_mod`: `torch.addcmul(shift, layer_norm(x), 1 + scale)`, whose product
    and sum round once (docs/numerics.md, 3.7)."""
    normed = F.layer_norm(x, (x.shape[-1],), eps=eps)
    if addcmul:
        return torch.addcmul(shift, normed, 1 + scale)
    return (1 + scale) * normed + shift


def gated_resnorm(
    residual: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float = 1e-6,
    update2: torch.Tensor | None = None,
    addcmul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, residual_out): `residual_out = residual + gate * update` (with update2:
    `residual + gate * (update + update2)`), then its modulated norm (`addcmul`: as `modnorm`)."""
    residual_out = Segment(residual, update, gate, update2=update2).materialize()
    return modnorm(residual_out, scale, shift, eps, addcmul=addcmul), residual_out


def per_segment(rows: Sequence[Segment], scale: Modulation, shift: Modulation) -> bool:
    """True where scale and shift are one tensor per segment, False where one tensor modulates every
    row; raises TypeError for anything else (a tuple and a tensor mixed, a tuple of the wrong length)."""
    tuples = type(scale) is tuple, type(shift) is tuple
    if not any(tuples):
        return False
    if not all(tuples):
        raise TypeError("scale and shift must both be tensors or both be tuples with one tensor per segment")
    if len(scale) != len(rows) or len(shift) != len(rows):
        raise TypeError(
            f"per-segment scale and shift need one tensor per segment ({len(rows)}), "
            f"got {len(scale)} and {len(shift)}"
        )
    return True


def segments(
    rows: Sequence[Segment], scale: Modulation, shift: Modulation, eps: float = 1e-6, *, addcmul: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, stream) for a site over one or two segments.

    One scale and shift for every row (FLUX.1/FLUX.2): the stream, then normalized and modulated
    (FLUX.2's single block norms its joint stream). A tuple with one per segment (FLUX.3's single
    block): each segment's stream normalized and modulated with its own rows, the outputs
    concatenated along tokens (text first, as diffusers' `cat([norm_text, norm_image], dim=1)`).
    LayerNorm and the modulation act row by row, so where the segments share one modulation the two
    forms give the same bits (docs/numerics.md, 3.6); each is written as its model writes it.
    `addcmul`: the modulation as `modnorm` computes it then.
    """
    parts = [segment.materialize() for segment in rows]
    joint = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    if not per_segment(rows, scale, shift):
        return modnorm(joint, scale, shift, eps, addcmul=addcmul), joint
    outs = [
        modnorm(part, sc, sh, eps, addcmul=addcmul) for part, sc, sh in zip(parts, scale, shift, strict=True)
    ]
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), joint


def stream(rows: Sequence[Segment]) -> torch.Tensor:
    """A site's input rows as one tensor: each segment materialized, concatenated along tokens
    (diffusers' `cat([text, image], dim=1)`)."""
    parts = [segment.materialize() for segment in rows]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
