"""CPU tests of the eager references and of `bits_equal`, the two things the self-check trusts.

The kernel is proven against the references, so they must be exactly the chains FLUX.2 and FLUX.3
(diffusers) write, op for op and rounding for rounding: compared with the chain written out longhand, they
must be torch.equal. `bits_equal` decides whether the kernel passes, so its semantics are pinned:
every bit counts (+0 is not -0), except that NaNs may differ in payload but not in position.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flux2_fused.ops import bits_equal
from flux2_fused.ops.gated_resnorm import Segment, gated_resnorm_reference, modnorm_reference, reference

from .conftest import flux2_inputs, flux3_inputs

B, T, D = 2, 7, 64
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def longhand(
    residual: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FLUX.2 site as diffusers writes it: (modulated norm, new residual stream)."""
    y = residual + gate * update
    out = (1 + scale) * F.layer_norm(y, (y.shape[-1],), eps=eps) + shift
    return out, y


def layouts(dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, ...]]:
    """(residual, update, gate, scale, shift): FLUX.2's strided chunks, broadcast rows, a [T, D] stream."""
    residual, update, gate, scale, shift = flux2_inputs(B, T, D, dtype)
    residual[0, 1] *= 1e3  # rows of very different magnitude, and a constant row
    residual[1, 2] = 0.375
    return {
        "FLUX.2 chunks": (residual, update, gate, scale, shift),
        "broadcast rows": (residual, update, gate[0, 0], scale[:1, 0], shift[:1]),
        "[T, D] stream": (residual[0], update[0], gate[0, 0], scale[0], shift[0]),
    }


@DTYPES
@pytest.mark.parametrize("layout", ["FLUX.2 chunks", "broadcast rows", "[T, D] stream"])
def test_gated_resnorm_reference_is_the_longhand_chain(dtype: torch.dtype, layout: str) -> None:
    args = layouts(dtype)[layout]
    out, residual_out = gated_resnorm_reference(*args)
    expected_out, expected_residual = longhand(*args)
    assert out.dtype == residual_out.dtype == dtype
    assert torch.equal(residual_out, expected_residual)
    assert torch.equal(out, expected_out)


@DTYPES
@pytest.mark.parametrize("layout", ["FLUX.2 chunks", "broadcast rows", "[T, D] stream"])
def test_modnorm_reference_is_the_longhand_chain(dtype: torch.dtype, layout: str) -> None:
    x, _, _, scale, shift = layouts(dtype)[layout]
    expected = (1 + scale) * F.layer_norm(x, (x.shape[-1],), eps=1e-6) + shift
    assert torch.equal(modnorm_reference(x, scale, shift), expected)


@DTYPES
def test_eps_reaches_the_layer_norm(dtype: torch.dtype) -> None:
    """Rows of tiny variance, where eps decides the output: the argument must not be ignored."""
    residual, update, gate, scale, shift = flux2_inputs(B, T, D, dtype)
    residual, update = residual * 1e-3, update * 1e-3
    out, _ = gated_resnorm_reference(residual, update, gate, scale, shift, eps=1e-2)
    assert torch.equal(out, longhand(residual, update, gate, scale, shift, eps=1e-2)[0])
    assert not torch.equal(out, gated_resnorm_reference(residual, update, gate, scale, shift)[0])
    assert torch.equal(
        modnorm_reference(residual, scale, shift, eps=1e-2), longhand(residual, 0, 0, scale, shift, 1e-2)[0]
    )


@DTYPES
def test_gated_add_is_two_roundings_not_addcmul(dtype: torch.dtype) -> None:
    """docs/numerics.md: `residual + gate * update` rounds the product, then the sum; addcmul rounds once.

    A reference rewritten with addcmul would look equivalent and differ in many elements.
    """
    residual, update, gate, scale, shift = flux2_inputs(4, 64, 256, dtype)
    _, residual_out = gated_resnorm_reference(residual, update, gate, scale, shift)
    assert not torch.equal(residual_out, torch.addcmul(residual, gate, update))


# --- FLUX.3 (diffusers' Flux3Transformer2DModel): per-token modulation, the two-term update, and the
# single block's two segments with their own modulation.


def flux3_mode_block_longhand(hidden, attn, ff, temb_mod, next_mod, eps=1e-6):
    """A FLUX.3 mode block's end and the next block's start, as diffusers writes them: the stream
    `hidden + gate * (attn + ff)`, then the next block's `(1 + scale) * norm(stream) + shift`."""
    _, _, gate = torch.chunk(temb_mod, 3, dim=-1)
    stream = hidden + gate * (attn + ff)
    shift, scale, _ = torch.chunk(next_mod, 3, dim=-1)
    return (1 + scale) * F.layer_norm(stream, (stream.shape[-1],), eps=eps) + shift, stream


@DTYPES
@pytest.mark.parametrize("batch", [1, 2])
def test_two_term_site_is_flux3s_chain(dtype: torch.dtype, batch: int) -> None:
    """`reference.gated_resnorm(..., update2=)` and a two-term `Segment` are FLUX.3's chain: the
    sum of the updates, the gate's product, the residual add and the per-token modulated norm."""
    gen = torch.Generator().manual_seed(3)
    hidden, attn, ff = (torch.randn(batch, 9, D, generator=gen).to(dtype) for _ in range(3))
    temb_mod, next_mod = (torch.randn(batch, 9, 3 * D, generator=gen).to(dtype) for _ in range(2))
    expected_out, expected_stream = flux3_mode_block_longhand(hidden, attn, ff, temb_mod, next_mod)
    gate = temb_mod.chunk(3, dim=-1)[2]
    shift, scale, _ = next_mod.chunk(3, dim=-1)
    out, stream = gated_resnorm_reference(hidden, attn, gate, scale, shift, update2=ff)
    assert torch.equal(stream, expected_stream) and torch.equal(out, expected_out)
    segment = Segment(hidden, attn, gate, update2=ff)
    assert torch.equal(segment.materialize(), expected_stream)
    out, stream = reference.segments([segment], scale, shift)
    assert torch.equal(stream, expected_stream) and torch.equal(out, expected_out)


def test_two_term_update_rounds_three_times() -> None:
    """docs/numerics.md 3.6: the sum of the updates is rounded to the dtype before the gate reads it.
    Distributing the gate, or keeping the sum in fp32, looks equivalent and differs."""
    residual, update, update2, gate, _, _ = flux3_inputs(4, 64, 256)
    stream = Segment(residual, update, gate, update2=update2).materialize()
    assert torch.equal(stream, residual + gate * (update + update2))
    assert not torch.equal(stream, residual + gate * update + gate * update2)
    f32 = residual.float() + gate.float() * (update.float() + update2.float())
    assert not torch.equal(stream, f32.to(stream.dtype))


@DTYPES
def test_per_token_modulation_is_eagers_broadcast(dtype: torch.dtype) -> None:
    """Per-token rows as eager broadcasts them: [B, T, D] chunk views row by row; a [T, D] or
    [1, T, D] tensor the same rows for every batch (never one row a batch)."""
    residual, update, _, gate, scale, shift = flux3_inputs(B, T, D, dtype)
    out, stream = gated_resnorm_reference(residual, update, gate, scale, shift)
    expected_out, expected_stream = longhand(residual, update, gate, scale, shift)
    assert torch.equal(stream, expected_stream) and torch.equal(out, expected_out)
    for b in range(B):  # row (b, t) reads modulation row (b, t)
        row_out, _ = gated_resnorm_reference(residual[b], update[b], gate[b], scale[b], shift[b])
        assert torch.equal(out[b], row_out)
    shared = (gate[0], scale[0], shift[0])  # [T, D]: one row a token, for every batch
    out, _ = gated_resnorm_reference(residual, update, *shared)
    out_3d, _ = gated_resnorm_reference(residual, update, *(t[None] for t in shared))
    assert torch.equal(out, out_3d)
    for b in range(B):
        assert torch.equal(out[b], gated_resnorm_reference(residual[b], update[b], *shared)[0])


def flux3_single_block_longhand(enc, hs, c_mod, mod, eps=1e-6):
    """diffusers' Flux3SingleTransformerBlock up to the joint buffer: each stream normalized and
    modulated with its own rows, text first."""
    c_shift, c_scale, _ = torch.chunk(c_mod, 3, dim=-1)
    shift, scale, _ = torch.chunk(mod, 3, dim=-1)
    norm_hs = (1 + scale) * F.layer_norm(hs, (hs.shape[-1],), eps=eps) + shift
    norm_enc = (1 + c_scale) * F.layer_norm(enc, (enc.shape[-1],), eps=eps) + c_shift
    return torch.cat([norm_enc, norm_hs], dim=1)


@DTYPES
@pytest.mark.parametrize("batch", [1, 2])
def test_per_segment_modulation_is_flux3s_single_block(dtype: torch.dtype, batch: int) -> None:
    """`reference.segments` with a tuple (one scale and shift per segment) over two pending two-term
    segments is FLUX.3's single block input: each stream materialized, normalized and modulated
    with its own rows, concatenated; the stream output is the concat of the two streams."""
    text, image = 7, 37
    r_t, u_t, v_t, g_t, _, _ = flux3_inputs(batch, text, D, dtype, seed=1)
    r_i, u_i, v_i, g_i, _, _ = flux3_inputs(batch, image, D, dtype, seed=2)
    gen = torch.Generator().manual_seed(4)
    c_mod = torch.randn(batch, text, 3 * D, generator=gen).to(dtype)
    mod = torch.randn(batch, image, 3 * D, generator=gen).to(dtype)
    enc, hs = r_t + g_t * (u_t + v_t), r_i + g_i * (u_i + v_i)
    rows = [Segment(r_t, u_t, g_t, update2=v_t), Segment(r_i, u_i, g_i, update2=v_i)]
    (c_shift, c_scale, _), (shift, scale, _) = c_mod.chunk(3, dim=-1), mod.chunk(3, dim=-1)
    out, stream = reference.segments(rows, (c_scale, scale), (c_shift, shift))
    assert torch.equal(stream, torch.cat([enc, hs], dim=1))
    assert torch.equal(out, flux3_single_block_longhand(enc, hs, c_mod, mod))


@DTYPES
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_shared_modulation_per_segment_is_the_concats_norm(dtype: torch.dtype, gated: bool) -> None:
    """LayerNorm and the modulation act row by row: one modulation for both segments (FLUX.2's single
    block norms the concat) and the same modulation given per segment (FLUX.3's form) are the same
    bits, on rows with constant, huge and tiny values. (On the GPU both are aten's vectorized
    LayerNorm per row: the concat and each materialized segment are fresh, aligned buffers.)"""
    residual, update, gate, scale, shift = flux2_inputs(B, T, D, dtype)
    txt, txt_update = flux2_inputs(B, 3, D, dtype, seed=5)[:2]
    residual[0, 1] *= 1e3
    residual[1, 2] = 0.375
    txt[0, 0] *= 1e-3
    if gated:
        rows = [Segment(txt, txt_update, gate), Segment(residual, update, gate)]
    else:
        rows = [Segment(txt), Segment(residual)]
    shared_out, shared_stream = reference.segments(rows, scale, shift)
    per_out, per_stream = reference.segments(rows, (scale, scale), (shift, shift))
    assert torch.equal(shared_stream, per_stream) and torch.equal(shared_out, per_out)
    assert torch.equal(
        shared_out, modnorm_reference(torch.cat([s.materialize() for s in rows], 1), scale, shift)
    )


def test_per_segment_form_is_checked() -> None:
    """A tuple and a tensor mixed, or a tuple of the wrong length, is no modulation eager could be
    handed: the reference raises instead of guessing."""
    residual, update, gate, scale, shift = flux2_inputs()
    rows = [Segment(residual, update, gate)] * 2
    assert reference.per_segment(rows, (scale, scale), (shift, shift))
    assert not reference.per_segment(rows, scale, shift)
    with pytest.raises(TypeError, match="both be tensors or both be tuples"):
        reference.segments(rows, scale, (shift, shift))
    with pytest.raises(TypeError, match=r"one tensor per segment \(2\), got 1 and 2"):
        reference.segments(rows, (scale,), (shift, shift))


def test_segment_keeps_flux2s_positional_form() -> None:
    """`Segment(residual, update, gate, deferred)` is unchanged; update2 is keyword-only, defaults to
    None, and rows(start) cuts it like the first update."""
    residual, update, update2, gate, _, _ = flux3_inputs(B, T, D)
    old = Segment(residual, update, gate, "kernel")
    assert old.deferred == "kernel" and old.update2 is None and old.gated
    with pytest.raises(TypeError):
        Segment(residual, update, gate, None, update2)  # type: ignore[misc]
    two = Segment(residual, update, gate, "kernel", update2=update2)
    tail = two.rows(2)
    assert tail.deferred == "kernel" and tail.update2 is not None
    assert torch.equal(tail.materialize(), two.materialize()[:, 2:])
    assert Segment(residual).materialize() is residual
    with pytest.raises(TypeError):  # a second update without a first is no stream eager computes
        Segment(residual, update2=update2).materialize()


BITS_DTYPES = pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)


def _int_type(dtype: torch.dtype) -> torch.dtype:
    return torch.int16 if dtype.itemsize == 2 else torch.int32


def _bits(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `dtype` with the given raw bit patterns (signed, as the same-size int holds them)."""
    return torch.tensor(values, dtype=_int_type(dtype)).view(dtype)


def _nan_patterns(dtype: torch.dtype) -> tuple[int, int, int]:
    """Three distinct NaNs: the canonical quiet NaN, another payload, and a negative one."""
    if dtype == torch.bfloat16:
        return 0x7FC0, 0x7FC1, -0x0040  # -0x0040 as int16 is 0xFFC0
    if dtype == torch.float16:
        return 0x7E00, 0x7E01, -0x0200  # 0xFE00
    return 0x7FC00000, 0x7FC00001, -0x00400000  # 0xFFC00000


@BITS_DTYPES
def test_bits_equal_equal_tensors(dtype: torch.dtype) -> None:
    a = torch.randn(3, 17).to(dtype)
    a[1, 2], a[2, 3] = float("inf"), -float("inf")
    assert bits_equal(a, a.clone())
    assert bits_equal(a.t(), a.clone().t())  # non-contiguous views compare by element


@BITS_DTYPES
def test_bits_equal_every_bit_counts(dtype: torch.dtype) -> None:
    a = torch.randn(64).to(dtype)
    b = a.clone()
    b.view(_int_type(dtype))[5] ^= 1  # one ulp
    assert not bits_equal(a, b)
    zero, negative_zero = torch.zeros(4, dtype=dtype), -torch.zeros(4, dtype=dtype)
    assert torch.equal(zero, negative_zero)  # what torch.equal misses
    assert not bits_equal(zero, negative_zero)
    assert not bits_equal(
        torch.full((2,), float("inf"), dtype=dtype), torch.full((2,), -float("inf"), dtype=dtype)
    )


@BITS_DTYPES
def test_bits_equal_nan_payloads_may_differ_positions_may_not(dtype: torch.dtype) -> None:
    quiet, payload, negative = _nan_patterns(dtype)
    one = int(torch.ones((), dtype=dtype).view(_int_type(dtype)))
    a = _bits([quiet, one, payload, one], dtype)
    assert bits_equal(a, _bits([negative, one, quiet, one], dtype))  # NaN vs NaN with other bits
    assert not bits_equal(a, _bits([quiet, one, one, one], dtype))  # a NaN became a number
    assert not bits_equal(a, _bits([one, quiet, payload, one], dtype))  # a NaN moved
    assert not bits_equal(a, _bits([quiet, one, payload, quiet], dtype))  # a number became NaN


def test_bits_equal_shape_or_dtype_mismatch_is_false() -> None:
    a = torch.randn(2, 3, dtype=torch.bfloat16)
    assert not bits_equal(a, a.reshape(3, 2))
    assert not bits_equal(a, a.reshape(6))
    assert not bits_equal(a, a[:1])
    assert not bits_equal(a, a.view(torch.float16))  # same bits, other dtype
    assert not bits_equal(a, a.float())


@pytest.mark.parametrize("dtype", [torch.float64, torch.uint8], ids=["fp64", "uint8"])
def test_bits_equal_other_element_sizes(dtype: torch.dtype) -> None:
    a = torch.arange(8).to(dtype)
    assert bits_equal(a, a.clone())
