"""Deferred gated residuals: `x + gate * update` left pending until the next LayerNorm consumes it.

A FLUX.2 residual stream is updated and then immediately re-read by a LayerNorm + adaLN. Instead of
materializing `x + gate * update` (two eager kernels) and then normalizing (four more), a block hands
on a `PendingGatedResidual` and the next norm runs one fused kernel that writes both the new stream
and the modulated norm. Whatever reads a stream otherwise (a concat, a slice, a hook, an fp16 clip,
a block's public forward) calls `materialize`, which is the eager chain itself, so a declined or
disabled fast path gives the same bits by the same code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import gated_resnorm as ops
from ..ops import library


@dataclass(frozen=True)
class PendingGatedResidual:
    """`residual + gate * update`, not yet computed. residual and update are [B, T, D]."""

    residual: torch.Tensor
    update: torch.Tensor
    gate: torch.Tensor

    def materialize(self) -> torch.Tensor:
        return self.residual + self.gate * self.update

    def rows(self, start: int) -> PendingGatedResidual:
        """The same pending update restricted to tokens [start:] (views; nothing is computed)."""
        return PendingGatedResidual(self.residual[:, start:], self.update[:, start:], self.gate)


@dataclass(frozen=True)
class PendingConcat:
    """`cat([first, second], dim=1)` of two streams, either of which may still be pending."""

    first: Stream
    second: Stream

    def materialize(self) -> torch.Tensor:
        return torch.cat([materialize(self.first), materialize(self.second)], dim=1)


Stream = torch.Tensor | PendingGatedResidual | PendingConcat


def materialize(stream: Stream) -> torch.Tensor:
    """The stream as a real tensor: the eager gated add (or concat) where something is pending."""
    return stream if isinstance(stream, torch.Tensor) else stream.materialize()


class ResidualFusion:
    """Where each residual site goes: fused (deferred) when the guards prove it exact, else eager.

    One instance is shared by a model and its blocks; `enabled` is the model's `fused` switch.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def _active(self) -> bool:
        """Eager mode with the fast path on: the guards decide site by site, here and now."""
        return self.enabled and not torch.compiler.is_compiling()

    def _traced(self) -> bool:
        """torch.compile tracing with the fast path on: the guards (data pointers, live self-checks)
        cannot be traced, so every site becomes a flux2_fused custom op that decides when it runs."""
        return self.enabled and torch.compiler.is_compiling()

    def add(self, x: Stream, gate: torch.Tensor, update: torch.Tensor, clip_fp16: bool = False) -> Stream:
        """`x + gate * update`, deferred where the next fused norm can consume it.

        clip_fp16: diffusers saturates this stream at +-65504 in fp16, which must happen before any
        reader, so such a site is always materialized.
        """
        x = materialize(x)
        if clip_fp16 and x.dtype == torch.float16:
            return (x + gate * update).clip(-65504.0, 65504.0)
        if self._traced() or (self._active() and ops.can_defer_flux2_gated_residual(x, update, gate)):
            return PendingGatedResidual(x, update, gate)
        return x + gate * update

    def norm(
        self, x: Stream, scale: torch.Tensor, shift: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the stream materialized, `(1 + scale) * layer_norm(stream) + shift`), in one launch when
        the fused kernel accepts the call."""
        if self._traced():
            if isinstance(x, PendingGatedResidual):
                out, stream = library.gated_resnorm(x.residual, x.update, x.gate, scale, shift, eps)
                return stream, out
            x = materialize(x)
            return x, library.modnorm(x, scale, shift, eps)
        if self._active():
            fused = self._fused_norm(x, scale, shift, eps, write_residual=True)
            if fused is not None:
                return fused
        x = materialize(x)
        return x, ops.modnorm_reference(x, scale, shift, eps)

    def output_norm(
        self, x: Stream, start: int, scale: torch.Tensor, shift: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """The modulated norm of tokens [start:] of a stream that nothing reads afterwards: the
        pending update of the other tokens is never computed and the stream itself never written."""
        if self._traced() and isinstance(x, PendingGatedResidual):
            rows = x.rows(start)
            return library.gated_resnorm(rows.residual, rows.update, rows.gate, scale, shift, eps)[0]
        if self._active() and isinstance(x, PendingGatedResidual):
            fused = self._fused_norm(x.rows(start), scale, shift, eps, write_residual=False)
            if fused is not None:
                return fused[1]  # the stream slot holds a placeholder: nothing reads it
        rows = materialize(x)[:, start:]
        return self.norm(rows, scale, shift, eps)[1]

    def _fused_norm(
        self, x: Stream, scale: torch.Tensor, shift: torch.Tensor, eps: float, write_residual: bool
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(stream, modulated norm) from one fused launch, or None where the guards decline.

        The stream is the materialized pending update (only written when write_residual), else x.
        A concat of two pending updates is written straight into its buffer by a two-segment launch;
        a concat with a real stream in it is materialized first (an fp16 clip site).
        """
        if isinstance(x, PendingConcat):
            first, second = x.first, x.second
            if isinstance(first, PendingGatedResidual) and isinstance(second, PendingGatedResidual):
                if first.residual.shape[0] != second.residual.shape[0] or not all(
                    ops.can_use_flux2_gated_resnorm(p.residual, p.update, p.gate, scale, shift)
                    for p in (first, second)
                ):
                    return None
                segments = [ops.Segment(p.residual, p.update, p.gate) for p in (first, second)]
                out, residual = ops.launch(segments, scale, shift, eps, write_residual=write_residual)
                return (residual if residual is not None else x.first.residual), out
            x = x.materialize()
        if isinstance(x, PendingGatedResidual):
            if not ops.can_use_flux2_gated_resnorm(x.residual, x.update, x.gate, scale, shift):
                return None
            segment = ops.Segment(x.residual, x.update, x.gate)
            out, residual = ops.launch([segment], scale, shift, eps, write_residual=write_residual)
            return (residual if residual is not None else x.residual), out
        if not ops.can_use_flux2_modnorm(x, scale, shift):
            return None
        return x, ops.launch([ops.Segment(x)], scale, shift, eps, write_residual=False)[0]
