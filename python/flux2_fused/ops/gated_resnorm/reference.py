"""The eager chains the kernel replaces: the contract, op for op as FLUX.2 (diffusers) writes them.

Whatever the fused path declines runs these, so a declined call gives the same bits by the same
code. The arithmetic each aten op performs, and why the kernel reproduces it, is in
docs/numerics.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows of a residual stream: `residual + gate * update`, or `residual` alone without an update.

    residual and update are [B, T, D] (or [T, D]); gate is a modulation row broadcast over tokens.
    A site's input is one segment, or two whose rows follow each other along tokens (a concat).
    """

    residual: torch.Tensor
    update: torch.Tensor | None = None
    gate: torch.Tensor | None = None
    # The verdict a gated segment was left pending with (`gated_resnorm.defer`): "kernel" when the
    # guard accepted its residual, update and gate, "traced" when a torch.compile trace left it for the
    # graph's operator; None for a segment nobody has judged.
    deferred: str | None = None

    @property
    def gated(self) -> bool:
        return self.update is not None

    def materialize(self) -> torch.Tensor:
        """The rows as eager computes them: two elementwise ops, each rounded to the stream dtype."""
        if self.update is None:
            return self.residual
        return self.residual + self.gate * self.update

    def rows(self, start: int) -> Segment:
        """The same rows restricted to tokens [start:] (views; nothing is computed)."""
        update = None if self.update is None else self.update[..., start:, :]
        gate = self.gate
        if gate is not None and gate.dim() >= 2 and gate.shape[-2] != 1:  # per-token rows
            gate = gate[..., start:, :]
        return Segment(self.residual[..., start:, :], update, gate, self.deferred)


def modnorm(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`(1 + scale) * layer_norm(x) + shift`, LayerNorm without affine, as eager computes it."""
    return (1 + scale) * F.layer_norm(x, (x.shape[-1],), eps=eps) + shift


def gated_resnorm(
    residual: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, residual_out): `residual_out = residual + gate * update`, then its modulated norm."""
    residual_out = residual + gate * update
    return modnorm(residual_out, scale, shift, eps), residual_out


def segments(
    rows: Sequence[Segment], scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, stream) for a site over one or two segments: the stream, then normalized and modulated."""
    joint = stream(rows)
    return modnorm(joint, scale, shift, eps), joint


def stream(rows: Sequence[Segment]) -> torch.Tensor:
    """A site's input rows as one tensor: each segment materialized, concatenated along tokens
    (diffusers' `cat([text, image], dim=1)`)."""
    parts = [segment.materialize() for segment in rows]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
