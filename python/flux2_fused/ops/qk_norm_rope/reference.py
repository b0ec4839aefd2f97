"""The eager attention prologue the kernel replaces: RMSNorm of each head of q and k, then RoPE, op
for op as diffusers' FLUX.2 attention processors write it, and a double block's concat of v; with
`upcast=True`, as diffusers' `Flux3AttnProcessor` writes it (FLUX.3).

A double block normalizes text and image rows with their own weights (`norm_added_q` / `norm_q`),
concatenates them text first, and rotates the joint rows; v's text and image rows are concatenated
alike. A single block normalizes and rotates its joint rows at once, and attention reads its v as it
is. RoPE is elementwise per (token, channel), so the rotation of a concat is the concat of the
rotations: the kernel writes both segments' rows straight into the joint buffers.

The rotation is the host's arithmetic (`ROTATIONS`): diffusers' is `x * cos + rotated * sin`, three
rounded fp32 ops ("aten"); ComfyUI rotates each pair by its 2x2 matrix (cos, -sin; sin, cos), whose
entries the tables carry (`comfy_tables`): its own torch code rounds the first product and adds the
second with one fma, torch's `addcmul` ("addcmul"); comfy-kitchen's CUDA kernel computes the second
product first and adds the first with one fma, flushing subnormals to zero ("kitchen"). The
references below are those operations in torch; "kitchen"'s is exact on CUDA, where torch's
`addcmul` is one fma.

Qwen-Image and Z-Image normalize with diffusers' own `RMSNorm` module ("mean": the variance from
`x.float().pow(2).mean(-1)`, `x * rsqrt(variance + eps)` rounded to the weight's dtype, then times
the weight) and rotate each pair as a complex number (`view_as_complex(x.float()) * freqs`,
"complex"), from complex frequencies [S, hd/2] (or one a batch) whose real and imaginary parts the
tables carry, each repeated for its channel pair (`complex_tables`).

FLUX.3 upcasts: `norm_q(query.float())` (an `nn.RMSNorm` whose weight stays float32), RoPE on that
fp32 result (`x.float()` and `.to(x.dtype)` are then no-ops), and one `.to(dtype)` at the end, so the
norm's output is never rounded to the 16-bit dtype. docs/numerics.md gives the arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows of one projection: x [B, S, H, head_dim] (a view of the Linear's output) and the RMSNorm
    weight [head_dim] that normalizes them."""

    x: torch.Tensor
    weight: torch.Tensor


# The hosts' q/k norms, by name (the kernel's `Norm`, in this order): `torch.nn.RMSNorm` (aten's fused
# kernel) and diffusers' `RMSNorm` module (its pow/mean chain).
NORMS = ("fused", "mean")
# The hosts' RoPE arithmetics, by name (the kernel's `Rotation`, in this order).
ROTATIONS = ("aten", "addcmul", "kitchen", "complex")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, norm: str = "fused") -> torch.Tensor:
    """The host's RMSNorm over the last dim (`NORMS`): `torch.nn.RMSNorm(head_dim, eps)` with this
    weight ("fused"), or diffusers' `RMSNorm` module with a weight of x's dtype ("mean")."""
    if norm == "fused":
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if norm != "mean":
        raise ValueError(f"flux2-fused: norm {norm!r} is not one of {NORMS}")
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + eps)).to(weight.dtype) * weight


def complex_tables(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Complex RoPE frequencies [S, hd/2] (or [B, S, hd/2]) as (cos, sin) tables [.., S, hd]: each
    frequency's real and imaginary part repeated for its channel pair (both exact copies)."""
    return (part.repeat_interleave(2, dim=-1).contiguous() for part in (freqs.real, freqs.imag))


FLT_MIN = torch.finfo(torch.float32).tiny


def comfy_tables(pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ComfyUI's rotation matrices pe [B, 1, S, hd/2, 2, 2] (fp32) as (cos, sin) tables [B, S, hd]:
    cos_2i = pe[.., 0, 0], sin_2i = -pe[.., 0, 1], sin_2i+1 = pe[.., 1, 0], cos_2i+1 = pe[.., 1, 1].
    The negation is exact, so the rotations read back ComfyUI's matrix entries bit for bit."""
    m = pe[:, 0]
    cos = torch.stack((m[..., 0, 0], m[..., 1, 1]), dim=-1).flatten(-2)
    sin = torch.stack((-m[..., 0, 1], m[..., 1, 0]), dim=-1).flatten(-2)
    return cos.contiguous(), sin.contiguous()


def _ftz(x: torch.Tensor) -> torch.Tensor:
    """Subnormal fp32 values flushed to zero of their sign, as fast-math CUDA code does."""
    return torch.where(x.abs() < FLT_MIN, x * 0.0, x)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotation: str = "aten") -> torch.Tensor:
    """Rotate interleaved channel pairs (GPT-J style) of x [B, S, H, hd] by the fp32 tables [S, hd]
    (or one a batch, [B, S, hd]) in the host's arithmetic (`ROTATIONS`), rounded once to x's dtype.
    The complex rotation reads the frequencies from the even channels' entries (`complex_tables`)."""
    cos, sin = (t[None, :, None, :] if t.dim() == 2 else t[:, :, None, :] for t in (cos, sin))
    if rotation == "aten":
        real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
        rotated = torch.stack([-imag, real], dim=-1).flatten(3)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)
    if rotation == "complex":  # Qwen-Image's and Z-Image's: channel 2i's entries are the frequency
        freqs = torch.complex(cos[..., ::2], sin[..., ::2])
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * freqs).flatten(3).to(x.dtype)
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    f00, f11 = cos.unflatten(-1, (-1, 2)).unbind(-1)
    minus_f01, f10 = sin.unflatten(-1, (-1, 2)).unbind(-1)
    f01 = -minus_f01
    if rotation == "addcmul":  # ComfyUI's `_apply_rope1`: the first product, then addcmul_
        y0 = (f00 * x0).addcmul_(f01, x1)
        y1 = (f10 * x0).addcmul_(f11, x1)
    elif rotation == "kitchen":  # comfy-kitchen: fma.ftz(f_0, x0, mul.ftz(f_1, x1))
        x0, x1, f00, f01, f10, f11 = (_ftz(t) for t in (x0, x1, f00, f01, f10, f11))
        y0 = _ftz(torch.addcmul(_ftz(f01 * x1), f00, x0))
        y1 = _ftz(torch.addcmul(_ftz(f11 * x1), f10, x0))
    else:
        raise ValueError(f"flux2-fused: rotation {rotation!r} is not one of {ROTATIONS}")
    return torch.stack((y0, y1), dim=-1).flatten(-2).to(x.dtype)


def qk_norm_rope(
    rows: Sequence[Segment],
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-6,
    *,
    upcast: bool = False,
    rotation: str = "aten",
    norm: str = "fused",
) -> torch.Tensor:
    """The joint rotated rows [B, sum S, H, hd]: each segment normalized with its weight by the
    host's norm (`norm`), concatenated along tokens in order, then rotated in the host's arithmetic
    (`rotation`). `upcast`: each segment widened to fp32 before its norm, norm and RoPE in fp32, the
    result rounded once to the rows' dtype (FLUX.3)."""
    normed = [
        rms_norm(segment.x.float() if upcast else segment.x, segment.weight, eps, norm) for segment in rows
    ]
    joint = normed[0] if len(normed) == 1 else torch.cat(normed, dim=1)
    out = rope(joint, cos, sin, rotation)
    return out.to(rows[0].x.dtype) if upcast else out


def prologue(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q, k, v) for attention: q's and k's joint rotated rows, and v's segments concatenated along
    tokens (None when v is not given: the single block's v needs no copy). `upcast`: FLUX.3's
    prologue, `rotation`: the host's RoPE arithmetic, `norm`: its q/k norm (see `qk_norm_rope`)."""
    value = None if v is None else torch.cat(list(v), dim=1)
    q_out, k_out = (
        qk_norm_rope(rows, cos, sin, eps, upcast=upcast, rotation=rotation, norm=norm) for rows in (q, k)
    )
    return q_out, k_out, value
