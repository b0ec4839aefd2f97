"""Deferred gated residuals: `x + gate * update` left pending until the next LayerNorm consumes it.

A FLUX.2 residual stream is updated and then immediately re-read by a LayerNorm + adaLN. Instead of
materializing `x + gate * update` (two eager kernels) and then normalizing (four more), a block hands
on a `PendingGatedResidual` and the next norm runs one fused kernel that writes both the new stream
and the modulated norm. Whatever reads a stream otherwise (a concat, a slice, a hook, an fp16 clip,
a block's public forward) calls `materialize`, which is the eager chain itself, so a declined or
disabled fast path gives the same bits by the same code path.

Every site reaches a kernel through its op's one entry point (`gated_resnorm.defer` and `apply`,
`qk_norm_rope.apply`, `swiglu.apply`), which also decides what a site becomes under torch.compile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..float8_linear import Quantized
from ..ops import gated_resnorm
from ..ops.gated_resnorm import ModulationRows, Segment
from ..ops.gated_resnorm.reference import Modulation
from ..ops.uniform_rows import UniformRows

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


def _waited(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t`, waited for where it is an all-reduce's output not yet waited on."""
    if AsyncCollectiveTensor is not None and type(t) is AsyncCollectiveTensor:
        return t.wait()
    return t


def _segments(x: Stream) -> list[Segment]:
    """The stream as the op's input rows: a concat of two pending updates stays two segments (the
    kernel writes the concat's buffer itself); any other concat is materialized first."""
    if isinstance(x, PendingConcat):
        if isinstance(x.first, Segment) and isinstance(x.second, Segment):
            return [x.first, x.second]
        return [Segment(x.materialize())]
    return [x if isinstance(x, Segment) else Segment(x)]


def clip_fp16_range(x: torch.Tensor) -> torch.Tensor:
    """diffusers' saturation of an fp16 stream: `clip(-65504, 65504)` (NaN stays NaN)."""
    return x.clip(-65504.0, 65504.0)


class Normed(NamedTuple):
    """A norm site's results: the modulated norm (or, asked for, torchao's per-row float8 of it), and
    the stream it normalized, materialized."""

    out: torch.Tensor | Quantized
    stream: torch.Tensor


class Fusion:
    """A model's switch and its residual streams between blocks: a gated update left pending where
    the next fused norm can consume it, materialized where anything else reads it.

    One instance is shared by a model and its blocks; `fused` is the model's switch, handed to each
    op's entry point as `enabled`. Which site runs the kernel, the eager chain or (under
    torch.compile) the op's operator is the op's decision, not this class's.
    """

    def __init__(
        self,
        fused: bool = True,
        *,
        addcmul: bool = False,
        saturate: Callable[[torch.Tensor], torch.Tensor] = clip_fp16_range,
    ) -> None:
        self.fused = fused
        # How the host rounds: its modulation as aten's addcmul (ComfyUI's `apply_mod`) rather than
        # diffusers' two ops, and how it saturates an fp16 stream (diffusers clips, ComfyUI maps
        # NaN to 0 as well).
        self.addcmul = addcmul
        self.saturate = saturate

    def __repr__(self) -> str:
        return f"Fusion(fused={self.fused}{', addcmul' if self.addcmul else ''})"

    def add(
        self,
        x: Stream,
        update: torch.Tensor,
        gate: torch.Tensor,
        clip_fp16: bool = False,
        update2: torch.Tensor | None = None,
        gate_rows: UniformRows | None = None,
    ) -> Stream:
        """`x + gate * update` (with `update2`: `x + gate * (update + update2)`, FLUX.3's parallel
        attention and MLP), deferred where the next fused norm can consume it.

        clip_fp16: the host saturates this stream at +-65504 in fp16 (`saturate`), which must happen
        before any reader, so such a site is always materialized. gate_rows: a proof that the gate's
        per-token rows are each batch's first (`uniform_rows`), for the kernel that consumes it.
        """
        x = materialize(x)
        # A tensor-parallel row-wise projection's all-reduced output, before its wait: the value is
        # what the wait gives (eager arithmetic waits on first use alike); the kernels read memory,
        # so they get the waited tensor.
        update, update2 = (_waited(t) for t in (update, update2))
        if clip_fp16 and x.dtype == torch.float16:
            return self.saturate(Segment(x, update, gate, update2=update2).materialize())
        return gated_resnorm.defer(x, update, gate, update2=update2, gate_rows=gate_rows, enabled=self.fused)

    def norm(
        self,
        x: Stream,
        scale: torch.Tensor,
        shift: torch.Tensor,
        eps: float,
        *,
        float8_rows: bool = False,
        mod_rows: UniformRows | None = None,
    ) -> Normed:
        """`(1 + scale) * layer_norm(stream) + shift` and the stream, in one launch where the fused
        kernel accepts the call.

        float8_rows: the caller's readers of the norm are torchao float8 Linears that quantize their
        input per row (`Host.float8_input`). The norm then comes as that quantization
        (`float8_linear.Quantized`, from the kernel's quantizing form) where the form accepts the
        call: the bf16 norm is neither written nor read back. A reader that needs the values after
        all computes them from the stream (`dense`), the same bits.

        mod_rows: a proof that scale's and shift's per-token rows are each batch's first
        (`uniform_rows`), which the kernel then reads for every token."""
        rows = _segments(x)
        got = self._quantized(rows, scale, shift, eps, True, mod_rows) if float8_rows else None
        if got is not None:
            q, q_scale, stream = got
            assert stream is not None
            return Normed(self._float8(q, q_scale, [stream], scale, shift, eps, mod_rows), stream)
        out, stream = self._apply(rows, scale, shift, eps, True, mod_rows)
        assert stream is not None
        return Normed(out, stream)

    def joint_norm(
        self,
        parts: tuple[Stream, Stream],
        scale: Modulation,
        shift: Modulation,
        eps: float,
        *,
        float8_rows: bool = False,
        mod_rows: ModulationRows = None,
    ) -> tuple[torch.Tensor | Quantized, torch.Tensor, torch.Tensor]:
        """FLUX.3's twin norms: each of two streams normalized with its own modulation (`scale` and
        `shift` tuples of two), into one joint buffer, text first; returns (joint norm, first
        stream, second stream). Two pending updates are consumed by the launch, which writes both
        streams; otherwise the streams are materialized first and the launch writes only the norm
        (one launch either way). float8_rows: as `norm`'s, the joint norm as torchao's per-row
        float8 where the quantizing form takes the call. mod_rows: proofs of equal rows for the two
        modulations (a tuple of two, each or both None), as `norm`'s."""
        first, second = parts
        pending = isinstance(first, Segment) and isinstance(second, Segment)
        rows = [first, second] if pending else [Segment(materialize(part)) for part in parts]
        got = self._quantized(rows, scale, shift, eps, pending, mod_rows) if float8_rows else None
        if got is None:
            out, joint = self._apply(rows, scale, shift, eps, pending, mod_rows)
        else:
            q, q_scale, joint = got
        if pending:
            assert joint is not None
            tokens = rows[0].residual.shape[-2]
            first, second = joint[:, :tokens], joint[:, tokens:]
        else:
            first, second = (segment.residual for segment in rows)
        if got is not None:
            out = self._float8(q, q_scale, [first, second], scale, shift, eps, mod_rows)
        return out, first, second

    def _apply(
        self,
        rows: list[Segment],
        scale: Modulation,
        shift: Modulation,
        eps: float,
        write_residual: bool,
        mod_rows: ModulationRows = None,
    ) -> gated_resnorm.Result:
        """(out, stream) of a norm site: `gated_resnorm.apply` with the model's switch and rounding."""
        return gated_resnorm.apply(
            rows,
            scale,
            shift,
            eps,
            write_residual=write_residual,
            enabled=self.fused,
            addcmul=self.addcmul,
            mod_rows=mod_rows,
        )

    def _quantized(
        self,
        rows: list[Segment],
        scale: Modulation,
        shift: Modulation,
        eps: float,
        write_residual: bool,
        mod_rows: ModulationRows,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """(q, q_scale, stream) of a norm site from the kernel's quantizing form (`float8_rows`);
        None where the form declines."""
        if not self.fused or self.addcmul:
            return None
        return gated_resnorm.quantized(
            rows, scale, shift, eps, write_residual=write_residual, mod_rows=mod_rows
        )

    def _float8(
        self,
        q: torch.Tensor,
        q_scale: torch.Tensor,
        streams: list[torch.Tensor],
        scale: Modulation,
        shift: Modulation,
        eps: float,
        mod_rows: ModulationRows,
    ) -> Quantized:
        """The quantizing form's (q, q_scale) as the norm's out for torchao's float8 Linears. Its
        `dense` computes the values from the normalized streams (one, or one a segment where each
        has its own modulation) with the plain kernel: the same bits."""

        def dense() -> torch.Tensor:
            plain = [Segment(t) for t in streams]
            return gated_resnorm.apply(
                plain, scale, shift, eps, write_residual=False, enabled=self.fused, mod_rows=mod_rows
            )[0]

        return Quantized(q, q_scale, "row", streams[0].dtype, dense)

    def output_norm(self, x: Stream, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
        """The modulated norm of a stream that nothing reads afterwards: a pending update is consumed
        by the norm and never written out."""
        return self._apply(_segments(x), scale, shift, eps, False)[0]
