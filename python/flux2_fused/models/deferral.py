"""Deferred gated residuals: `x + gate * update` left pending until the next LayerNorm consumes it.

A FLUX.2 residual stream is updated and then immediately re-read by a LayerNorm + adaLN. Instead of
materializing `x + gate * update` (two eager kernels) and then normalizing (four more), a block hands
on a `PendingGatedResidual` and the next norm runs one fused kernel that writes both the new stream
and the modulated norm. Whatever reads a stream otherwise (a concat, a slice, a hook, an fp16 clip,
a block's public forward) calls `materialize`, which is the eager chain itself, so a declined or
disabled fast path gives the same bits by the same code path.

Every site reaches a kernel through its op's one entry point (`gated_resnorm.apply`,
`qk_norm_rope.apply`, `swiglu.apply`) in eager mode, or the op's torch.library operators under
torch.compile, where the guards cannot be traced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..ops import gated_resnorm, qk_norm_rope, swiglu
from ..ops.gated_resnorm import Segment

try:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
except ImportError:  # a torch built without distributed
    AsyncCollectiveTensor = None

# `residual + gate * update`, not yet computed: the op's gated segment (residual and update [B, T, D]).
PendingGatedResidual = Segment


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


def stream_dtype(x: Stream) -> torch.dtype:
    """The dtype the stream has once materialized."""
    if isinstance(x, PendingConcat):
        return stream_dtype(x.first)
    return x.dtype if isinstance(x, torch.Tensor) else x.residual.dtype


def stream_rows(x: Stream, start: int) -> Stream:
    """Tokens [start:] of a stream; a pending update stays pending, so only those rows are ever
    computed (elementwise, so they equal the same rows of the whole stream bit for bit)."""
    return x.rows(start) if isinstance(x, Segment) else materialize(x)[:, start:]


def _segments(x: Stream) -> list[Segment]:
    """The stream as the op's input rows: a concat of two pending updates stays two segments (the
    kernel writes the concat's buffer itself); any other concat is materialized first."""
    if isinstance(x, PendingConcat):
        if isinstance(x.first, Segment) and isinstance(x.second, Segment):
            return [x.first, x.second]
        return [Segment(x.materialize())]
    return [x if isinstance(x, Segment) else Segment(x)]


class Normed(NamedTuple):
    """A norm site's results: the modulated norm, and the stream it normalized, materialized."""

    out: torch.Tensor
    stream: torch.Tensor


class Fusion:
    """Where each fusable site goes: the fused op (a residual deferred into the next norm, the
    attention prologue) where the guards prove it exact, else the eager chain.

    One instance is shared by a model and its blocks (handed to each block's constructor); `fused`
    is the model's switch.
    """

    def __init__(self, fused: bool = True) -> None:
        self.fused = fused

    def _active(self) -> bool:
        """Eager mode with the fast path on: the guards decide site by site, here and now."""
        return self.fused and not torch.compiler.is_compiling()

    def _traced(self) -> bool:
        """torch.compile tracing with the fast path on: the guards (data pointers, live self-checks)
        cannot be traced, so every site becomes a flux2_fused operator that decides when it runs."""
        return self.fused and torch.compiler.is_compiling()

    def add(self, x: Stream, update: torch.Tensor, gate: torch.Tensor, clip_fp16: bool = False) -> Stream:
        """`x + gate * update`, deferred where the next fused norm can consume it.

        clip_fp16: diffusers saturates this stream at +-65504 in fp16, which must happen before any
        reader, so such a site is always materialized.
        """
        x = materialize(x)
        if AsyncCollectiveTensor is not None and type(update) is AsyncCollectiveTensor:
            # A tensor-parallel row-wise projection's all-reduced output, before its wait: the value
            # is what the wait gives (eager arithmetic waits on first use alike); the kernels read
            # memory, so they get the waited tensor.
            update = update.wait()
        if clip_fp16 and x.dtype == torch.float16:
            return (x + gate * update).clip(-65504.0, 65504.0)
        if self._traced() or (self._active() and gated_resnorm.can_defer(x, update, gate)):
            return PendingGatedResidual(x, update, gate)
        return x + gate * update

    def norm(self, x: Stream, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> Normed:
        """`(1 + scale) * layer_norm(stream) + shift` and the stream, in one launch where the fused
        kernel accepts the call."""
        if self._traced():
            return Normed(*self._traced_norm(x, scale, shift, eps))
        if not self._active():
            stream = materialize(x)
            return Normed(gated_resnorm.modnorm_reference(stream, scale, shift, eps), stream)
        out, stream = gated_resnorm.apply(_segments(x), scale, shift, eps, write_residual=True)
        assert stream is not None
        return Normed(out, stream)

    def output_norm(self, x: Stream, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
        """The modulated norm of a stream that nothing reads afterwards: a pending update is consumed
        by the norm and never written out."""
        if self._traced():
            return self._traced_norm(x, scale, shift, eps)[0]
        if not self._active():
            return gated_resnorm.modnorm_reference(materialize(x), scale, shift, eps)
        return gated_resnorm.apply(_segments(x), scale, shift, eps, write_residual=False)[0]

    @staticmethod
    def _traced_norm(
        x: Stream, scale: torch.Tensor, shift: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, stream) through the flux2_fused operators, which decide at run time."""
        from ..ops.gated_resnorm import library

        if isinstance(x, Segment) and x.gated:
            return library.gated_resnorm(x.residual, x.update, x.gate, scale, shift, eps)
        stream = x.residual if isinstance(x, Segment) else materialize(x)
        return library.modnorm(stream, scale, shift, eps), stream

    def qk_norm_rope(
        self,
        q: list[qk_norm_rope.Segment],
        k: list[qk_norm_rope.Segment],
        rope: tuple[torch.Tensor, torch.Tensor],
        eps: float,
        v: list[torch.Tensor] | None = None,
    ) -> qk_norm_rope.Prologue:
        """(q, k, v) for attention: each q and k segment's heads RMS-normalized with its weight,
        concatenated along tokens, rotated; v's segments concatenated (None when not given). One
        kernel launch where it accepts, else diffusers' chain."""
        cos, sin = rope
        if self._traced():
            from ..ops.qk_norm_rope import library

            out = library.qk_norm_rope(
                [s.x for s in q],
                [s.weight for s in q],
                [s.x for s in k],
                [s.weight for s in k],
                v or [],
                cos,
                sin,
                eps,
            )
            return out[0], out[1], out[2] if v else None
        if self._active():
            return qk_norm_rope.apply(q, k, cos, sin, eps, v)
        return qk_norm_rope.reference.prologue(q, k, cos, sin, eps, v)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(a) * b` for x = [a, b]: one launch reading the projection in place where it accepts."""
        if self._traced():
            from ..ops.swiglu import library

            return library.swiglu(x)
        if self._active():
            return swiglu.apply(x)
        return swiglu.reference.swiglu(x)

    def cat_swiglu(self, attn: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
        """`cat([attn, swiglu(mlp)], dim=-1)`, the single block's output-projection input: in eager
        mode the activation is written straight into its half of the buffer (no second copy)."""
        if not self._active():
            return torch.cat([attn, self.swiglu(mlp)], dim=-1)
        width = attn.shape[-1]
        joint = attn.new_empty((*attn.shape[:-1], width + mlp.shape[-1] // 2))
        joint[..., :width].copy_(attn)
        swiglu.apply(mlp, out=joint[..., width:])
        return joint
