"""Property-based fuzzing on the GPU: whatever the guards accept equals eager bit for bit, and whatever
the model path is handed (accepted or not) equals eager bit for bit.

Accepted draws cover FLUX.2's and FLUX.3's layouts at random sizes: any D % 4 == 0 up to MAX_DIM
(ROW_MOD_MAX_DIM with rows per token), odd token counts, batch 1-3, [T, D] and [B, T, D] streams
(dense, or the last rows of a longer stream), one update or two (FLUX.3's `residual + gate *
(update + update2)`), modulation as chunk views, [B, 1, D], [1, 1, D], [1, D], [D] or
batch-expanded rows, or per token (chunks of [B, T, 3D], [T, D], [1, T, D], batch-expanded), and
values from randn at several scales up to random bit patterns (NaN, Inf, subnormals). Rejected draws
break one or two things the kernel cannot reproduce (dtype, alignment, strides, D, grad, device,
eager broadcasting) and go through `Fusion`, the code every model site runs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from flux2_fused.models.deferral import Fusion, stream_rows
from flux2_fused.ops import bits_equal, gated_resnorm, random_bits
from flux2_fused.ops.gated_resnorm import (
    MAX_DIM,
    ROW_MOD_MAX_DIM,
    gated_resnorm_decline_reason,
    gated_resnorm_reference,
    modnorm,
    modnorm_decline_reason,
    modnorm_reference,
)

pytestmark = pytest.mark.gpu

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MAX_ELEMENTS = 1 << 22  # per stream: keeps a draw well under a millisecond of kernel time
SCALES = [1.0, 1.0, 1e3, 1e-3, 1e-30, 1e30, "bits"]
MOD_LAYOUTS = ["chunk", "batch", "broadcast-3d", "broadcast-2d", "broadcast-1d", "expand"]
MOD_LAYOUTS += ["token-chunk", "token-2d", "token-3d", "token-expand"]  # per token (FLUX.3)
BREAKS = ["fp32", "misaligned", "transposed", "step", "dim-not-4", "dim-too-big", "grad", "cpu"]
BREAKS += ["update-broadcast", "token-rows"]


@dataclasses.dataclass(frozen=True)
class Site:
    batch: int
    tokens: int
    dim: int
    dtype: torch.dtype
    rank: int  # 2: [T, D] streams, 3: [B, T, D]
    row_offset: int  # > 0: streams are the last rows of a longer one
    mod_layout: str
    scales: tuple  # residual, update, modulation
    two_term: bool  # a second update: residual + gate * (update + update2)


@st.composite
def sites(draw: st.DrawFn) -> Site:
    vectors = st.one_of(st.integers(1, 64), st.integers(1, MAX_DIM // 4), st.sampled_from([768, 1024, 1536]))
    mod_layout = draw(st.sampled_from(MOD_LAYOUTS))
    dim = 4 * draw(vectors)
    if mod_layout.startswith("token"):  # rows per token: built for D up to ROW_MOD_MAX_DIM
        dim = min(dim, ROW_MOD_MAX_DIM)
    rank = draw(st.sampled_from([2, 3, 3]))
    batch = draw(st.integers(1, 3)) if rank == 3 else 1
    tokens = draw(st.integers(1, max(1, min(700, MAX_ELEMENTS // (batch * dim)))))
    return Site(
        batch=batch,
        tokens=tokens,
        dim=dim,
        dtype=draw(st.sampled_from([torch.bfloat16, torch.bfloat16, torch.float16])),
        rank=rank,
        row_offset=draw(st.sampled_from([0, 0, 1, 3])),
        mod_layout=mod_layout,
        scales=tuple(draw(st.sampled_from(SCALES)) for _ in range(3)),
        two_term=draw(st.booleans()),
    )


def _values(shape: tuple[int, ...], scale, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if scale == "bits":
        return random_bits(shape, dtype, gen)
    return (torch.randn(shape, generator=gen, device="cuda") * scale).to(dtype)


def build(site: Site, gen: torch.Generator) -> tuple[torch.Tensor | None, ...]:
    """(residual, update, gate, scale, shift, update2) for a site, every tensor one the guards
    accept (update2 None for a one-term site)."""
    b, t, d, dt = site.batch, site.tokens, site.dim, site.dtype
    lead = (b,) if site.rank == 3 else ()

    def stream(scale) -> torch.Tensor:
        full = _values((*lead, t + site.row_offset, d), scale, dt, gen)
        return full[..., site.row_offset :, :]

    residual, update = stream(site.scales[0]), stream(site.scales[1])
    update2 = stream(site.scales[1]) if site.two_term else None
    rows = b if site.rank == 3 else 1
    mod_scale = site.scales[2]
    if site.mod_layout == "chunk":  # FLUX.2: strided [B, 1, D] views of one [B, 1, 6D] tensor
        mods = _values((rows, 1, 6 * d), mod_scale, dt, gen).chunk(6, dim=-1)[3:]
    elif site.mod_layout == "batch":
        mods = [_values((rows, 1, d), mod_scale, dt, gen) for _ in range(3)]
    elif site.mod_layout == "expand":
        mods = [_values((1, 1, d), mod_scale, dt, gen).expand(rows, 1, d) for _ in range(3)]
    elif site.mod_layout == "token-chunk":  # FLUX.3: strided [B, T, D] views of one [B, T, 3D] tensor
        mods = _values((rows, t, 3 * d), mod_scale, dt, gen).chunk(3, dim=-1)
    elif site.mod_layout == "token-2d":  # [T, D] rows shared by the batch (chunks of [T, 3D])
        mods = _values((t, 3 * d), mod_scale, dt, gen).chunk(3, dim=-1)
    elif site.mod_layout == "token-3d":
        mods = [_values((1, t, d), mod_scale, dt, gen) for _ in range(3)]
    elif site.mod_layout == "token-expand":
        mods = [_values((1, t, d), mod_scale, dt, gen).expand(rows, t, d) for _ in range(3)]
    else:
        shape = {"broadcast-3d": (1, 1, d), "broadcast-2d": (1, d), "broadcast-1d": (d,)}[site.mod_layout]
        mods = [_values(shape, mod_scale, dt, gen) for _ in range(3)]
    gate, scale, shift = mods
    return residual, update, gate, scale, shift, update2


@pytest.fixture(scope="module")
def gen() -> torch.Generator:
    """Module-scoped (hypothesis refuses function-scoped fixtures in @given tests); still freshly seeded."""
    g = torch.Generator(device="cuda")
    g.seed()
    return g


@settings(FUZZ, max_examples=400)
@given(site=sites())
def test_accepted_inputs_equal_eager(site: Site, gen: torch.Generator) -> None:
    residual, update, gate, scale, shift, update2 = build(site, gen)
    assert gated_resnorm_decline_reason(residual, update, gate, scale, shift, update2=update2) is None
    assert modnorm_decline_reason(residual, scale, shift) is None
    out, residual_out = gated_resnorm.gated_resnorm(residual, update, gate, scale, shift, update2=update2)
    ref_out, ref_residual = gated_resnorm_reference(residual, update, gate, scale, shift, update2=update2)
    assert bits_equal(residual_out, ref_residual)
    assert bits_equal(out, ref_out)
    assert bits_equal(modnorm(residual, scale, shift), modnorm_reference(residual, scale, shift))


def _break(kind: str, tensors: list[torch.Tensor | None], which: int) -> list[torch.Tensor | None]:
    """The same site with one thing the kernel cannot reproduce (or eager handles differently)."""
    t = tensors[which]
    if t is None:  # the update2 of a one-term site
        return tensors
    match kind:
        case "fp32":
            t = t.float()
        case "misaligned":  # same values, data pointer 2 bytes past 8-byte alignment
            flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
            t = flat[1:].view(t.shape).copy_(t)
        case "transposed" if t.dim() >= 2:  # same shape and values, column-major memory
            t = t.mT.contiguous().mT
        case "step":
            wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
            wide[..., ::2] = t
            t = wide[..., ::2]
        case "grad":
            t = t.detach().float().requires_grad_().to(t.dtype) if t.is_floating_point() else t
        case "cpu":
            return [None if x is None else x.cpu() for x in tensors]
        case "update-broadcast" if which in (1, 5) and t.dim() == 3:  # [1, T, D] update, eager broadcasts it
            t = t[:1]
        case "token-rows" if which in (2, 3, 4) and t.dim() >= 2 and t.shape[-2] > 2:  # too few token rows
            t = t[..., :-1, :]
    tensors = list(tensors)
    tensors[which] = t
    return tensors


def _site_for_break(kind: str, site: Site) -> Site:
    if kind == "dim-not-4":
        return dataclasses.replace(site, dim=site.dim + 2)
    if kind == "dim-too-big":
        return dataclasses.replace(site, dim=MAX_DIM + 4, tokens=min(site.tokens, 8), batch=1)
    return site


@settings(FUZZ, max_examples=300)
@given(site=sites(), breaks=st.lists(st.tuples(st.sampled_from(BREAKS), st.integers(0, 5)), max_size=2))
def test_model_path_equals_eager(site: Site, breaks: list, gen: torch.Generator) -> None:
    """Accepted or not, a site through Fusion (add, norm, output_norm; a two-term update through
    `gated_resnorm.defer`, as FLUX.3's blocks leave it) gives eager's bits."""
    for kind, _ in breaks:
        site = _site_for_break(kind, site)
    if site.dim % 4 != 0:  # an odd D can't come from a chunked [.., 6D] row with dim % 4: build dense
        site = dataclasses.replace(site, mod_layout="batch")
    tensors = list(build(site, gen))
    for kind, which in breaks:
        tensors = _break(kind, tensors, which)
    residual, update, gate, scale, shift, update2 = tensors
    with torch.no_grad() if not any(k == "grad" for k, _ in breaks) else torch.enable_grad():
        try:
            eager_stream = residual + gate * (update if update2 is None else update + update2)
            eager_out = modnorm_reference(eager_stream, scale, shift)
        except RuntimeError:  # eager itself rejects the combination (devices, shapes): nothing to match
            event("eager raises")
            return
        reason = gated_resnorm_decline_reason(residual, update, gate, scale, shift, update2=update2)
        event(
            ("declined" if reason is not None else "accepted") + (", two-term" if update2 is not None else "")
        )
        fusion = Fusion(fused=True)

        def add() -> object:
            if update2 is None:
                return fusion.add(residual, update, gate)
            return gated_resnorm.defer(residual, update, gate, update2=update2, enabled=fusion.fused)

        out, stream = fusion.norm(add(), scale, shift, 1e-6)
        assert bits_equal(stream.detach(), eager_stream.detach())
        assert bits_equal(out.detach(), eager_out.detach())
        if residual.dim() == 3 and eager_stream.shape == residual.shape and residual.shape[1] > 1:
            start = eager_stream.shape[1] // 2
            pending = add()
            tail_scale, tail_shift = (
                t[..., start:, :] if t.dim() >= 2 and t.shape[-2] > 1 else t for t in (scale, shift)
            )
            tail = fusion.output_norm(stream_rows(pending, start), tail_scale, tail_shift, 1e-6)
            eager_tail = modnorm_reference(eager_stream[:, start:], tail_scale, tail_shift)
            assert bits_equal(tail.detach(), eager_tail.detach())
