"""CPU tests of the eager references and of `bits_equal`, the two things the self-check trusts.

The kernel is proven against the references, so they must be exactly the chain FLUX.2 (diffusers)
writes, op for op and rounding for rounding: compared with the chain written out longhand, they
must be torch.equal. `bits_equal` decides whether the kernel passes, so its semantics are pinned:
every bit counts (+0 is not -0), except that NaNs may differ in payload but not in position.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flux2_fused.ops import bits_equal
from flux2_fused.ops.gated_resnorm import gated_resnorm_reference, modnorm_reference

from .conftest import flux2_inputs

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
