"""qk_norm_rope: the attention prologue, per-head RMSNorm with weight then RoPE of q and k, fused.

The entry point for models is `apply(q, k, cos, sin, eps, v=None) -> (q, k, v)`: attention's joint
rotated q and k [B, S, H, 128] (and v's joint rows) from one kernel launch where the guards prove it
exact, else from the eager chain of `reference`, bit for bit the same; under a torch.compile trace
the `library` operator, which decides when the graph runs. `q` and `k` are one segment
each (a single block's joint rows) or two (a double block's text then image rows, each with its own
RMSNorm weight); `v`, a double block's text and image v, is concatenated in the same launch, so the
eager `cat`s disappear, and the token's RoPE tables are read once for q and k. `upcast=True` is
FLUX.3's prologue: `norm(q.float())` with a float32 RMSNorm weight, RoPE on the fp32 result and one
rounding to q's dtype at the end (diffusers' `Flux3AttnProcessor`), in the same launch. `rotation` is
the host's RoPE arithmetic: diffusers' ("aten"), or ComfyUI's, whose torch code ("addcmul") and
comfy-kitchen's CUDA kernel ("kitchen") round otherwise (docs/numerics.md, 12), or the complex product
of Qwen-Image and Z-Image ("complex"), which goes with `norm="mean"`: their q/k norm is diffusers' own
`RMSNorm` module, a pow/mean chain, not aten's fused `rms_norm` ("fused"). `fused` is the
same decision without the fallback; `qk_norm_rope` is the validated op that raises for inputs the
kernel cannot take.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import guards, reference
from .guards import SUPPORTED_DTYPES, segment_decline_reason, value_decline_reason
from .launch import KERNEL, launch
from .reference import Segment
from .selfcheck import HEAD_DIM, OP, Config, self_check

Prologue = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _layout_reason(
    q: Sequence[Segment], k: Sequence[Segment], cos: torch.Tensor, v: Sequence[torch.Tensor] | None
) -> str | None:
    """What one launch cannot do with these segments, whatever each segment's own layout."""
    if len(q) not in (1, 2):
        return f"a launch takes one or two segments, got {len(q)}"
    if len(k) != len(q) or (v is not None and len(v) != len(q)):
        return "q, k and v have different numbers of segments"
    first = q[0].x
    for i, segment in enumerate(q):
        inputs = [segment.x, k[i].x] + ([v[i]] if v is not None else [])
        for x in inputs:
            if x.dim() != 4 or first.dim() != 4 or x.shape[::2] != first.shape[::2]:
                return "the segments differ in batch or heads"
            if x.shape[1] != segment.x.shape[1]:
                return "q, k and v segments differ in tokens"
            if x.dtype != first.dtype or x.device != first.device:
                return "the segments differ in dtype or device"
    tokens = sum(segment.x.shape[1] for segment in q)
    rows = cos.shape[-2] if cos.dim() >= 2 else 0
    if cos.dim() not in (2, 3) or rows != tokens:
        return f"the RoPE tables have {rows} rows, the segments {tokens} tokens"
    return None


def _is_number(eps: object) -> bool:
    return isinstance(eps, float | int) and not isinstance(eps, bool)


def decline_reason(
    q: Sequence[Segment],
    k: Sequence[Segment],
    cos: torch.Tensor,
    sin: torch.Tensor,
    v: Sequence[torch.Tensor] | None = None,
    *,
    upcast: bool = False,
    rotation: str = "aten",
    norm: str = "fused",
) -> str | None:
    """Why `fused(q, k, cos, sin, eps, v, upcast=upcast, rotation=rotation, norm=norm)` declines, or
    None when it launches the kernel."""
    mode = {"upcast": upcast, "rotation": rotation, "norm": norm}
    reason = guards.mode_reason(upcast, rotation, norm)
    for segment in (*q, *k):
        reason = reason or segment_decline_reason(segment.x, segment.weight, cos, sin, **mode)
    for x in v or ():
        reason = reason or value_decline_reason(x, **mode)
    return reason or _layout_reason(q, k, cos, v)


def fused(
    q: Sequence[Segment],
    k: Sequence[Segment],
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    v: Sequence[torch.Tensor] | None = None,
    *,
    upcast: bool = False,
    rotation: str = "aten",
    norm: str = "fused",
) -> Prologue | None:
    """(q, k, v) from one kernel launch, or None where the guards decline."""
    if not _is_number(eps) or guards.mode_reason(upcast, rotation, norm) is not None:
        return None  # eps=None means aten's own default, not ours to guess
    try:
        segment_guard = guards.segment_guard(upcast, rotation, norm)
        value_guard = guards.value_guard(upcast, rotation, norm)
        for segment in (*q, *k):
            if not segment_guard(segment.x, segment.weight, cos, sin):
                return None
        if v is not None and not all(value_guard(x) for x in v):
            return None
        if _layout_reason(q, k, cos, v) is not None:
            return None
    except Exception:  # not segments of tensors: declined, as the guards decline garbage
        return None
    return launch(q, k, cos, sin, eps, v, upcast=bool(upcast), rotation=rotation, norm=norm)


def apply(
    q: Sequence[Segment],
    k: Sequence[Segment],
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    v: Sequence[torch.Tensor] | None = None,
    *,
    upcast: bool = False,
    rotation: str = "aten",
    norm: str = "fused",
    enabled: bool = True,
) -> Prologue:
    """The site's one decision: under a torch.compile trace the `library` operator, else `fused`
    where it accepts, else the eager chain (`reference.prologue`): the same bits. `upcast=True` is
    FLUX.3's prologue (norm and RoPE on the rows widened to fp32, a float32 weight, one rounding);
    `rotation` the host's RoPE arithmetic (`reference.ROTATIONS`: diffusers' "aten", ComfyUI's
    "addcmul" and "kitchen", Qwen-Image's "complex"), `norm` its q/k norm (`reference.NORMS`).
    `enabled=False` (a model's switch) always runs the eager chain."""
    # eps=None (aten's own default) is not an operator argument: the trace keeps the eager chain.
    if enabled and torch.compiler.is_compiling() and _is_number(eps):
        from . import library

        out = library.qk_norm_rope(
            [s.x for s in q],
            [s.weight for s in q],
            [s.x for s in k],
            [s.weight for s in k],
            v or [],
            cos,
            sin,
            eps,
            bool(upcast),
            rotation,
            norm,
        )
        return out[0], out[1], out[2] if v else None
    mode = {"upcast": upcast, "rotation": rotation, "norm": norm}
    out = fused(q, k, cos, sin, eps, v, **mode) if enabled else None
    if out is not None:
        return out
    return reference.prologue(q, k, cos, sin, eps, v, **mode)


def qk_norm_rope(
    q: Sequence[Segment],
    k: Sequence[Segment],
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-6,
    v: Sequence[torch.Tensor] | None = None,
    *,
    upcast: bool = False,
    rotation: str = "aten",
    norm: str = "fused",
) -> Prologue:
    """The kernel, without the self-check: (q, k, v), each joint [B, sum S, H, 128], v None when not
    given; `upcast=True` in FLUX.3's mode (a float32 weight, norm and RoPE in fp32); `rotation` the
    host's RoPE arithmetic (`reference.ROTATIONS`), `norm` its q/k norm (`reference.NORMS`).

    Unsupported inputs raise TypeError (types, dtypes, devices) or ValueError (shapes, strides,
    alignment, an unknown mode) naming the problem.
    """
    reason = guards.mode_reason(upcast, rotation, norm)
    if reason is not None:
        raise ValueError(f"flux2-fused: {reason}")
    for segment in (*q, *k):
        guards.segment_guard(upcast, rotation, norm).validate(segment.x, segment.weight, cos, sin)
    for x in v or ():
        guards.value_guard(upcast, rotation, norm).validate(x)
    reason = _layout_reason(q, k, cos, v)
    if reason is not None:
        raise ValueError(f"flux2-fused: {reason}")
    return launch(q, k, cos, sin, eps, v, upcast=bool(upcast), rotation=rotation, norm=norm)


__all__ = [
    "HEAD_DIM",
    "KERNEL",
    "OP",
    "SUPPORTED_DTYPES",
    "Config",
    "Prologue",
    "Segment",
    "apply",
    "decline_reason",
    "fused",
    "guards",
    "qk_norm_rope",
    "reference",
    "segment_decline_reason",
    "self_check",
    "value_decline_reason",
]
