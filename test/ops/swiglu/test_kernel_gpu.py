"""GPU tests: the swiglu kernel equals eager bit for bit (run with `pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.ops import bits_equal, every_bit_pattern, random_bits
from flux2_fused.ops.swiglu import decline_reason, guards, reference, swiglu

from ..conftest import assert_runs_on_its_tensors_device, assert_streams_and_graph_capture

pytestmark = pytest.mark.gpu


def _rows(batch: int, tokens: int, hidden: int, dtype: torch.dtype, gen: torch.Generator, extra: int = 0):
    """[B, S, 2H] (a view of a wider projection when extra > 0) across silu's whole range."""
    wide = torch.randn(batch, tokens, extra + 2 * hidden, generator=gen, device="cuda") * 5
    wide[:, 1::7] *= 30  # exp(-a) overflows for large negative a: silu -> -0
    wide[:, 2::7] *= 1e-4
    wide[:, 3::11, 5] = float("nan")
    wide[:, 4::13, 6] = float("inf")
    wide[:, 5::13, 7] = -float("inf")
    return wide.to(dtype)[..., extra:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("tokens", [1, 7, 512, 4096])
@pytest.mark.parametrize("hidden", [9216, 18432, 12, 1028])
def test_dense_projection_bit_exact(hidden, tokens, batch, dtype, gen):
    x = _rows(batch, tokens, hidden, dtype, gen)
    assert decline_reason(x) is None
    out = swiglu(x)
    assert out.is_contiguous() and bits_equal(out, reference.swiglu(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [3, 4608])
def test_single_block_layout_into_half_of_the_buffer(tokens, dtype, gen):
    """The MLP part of one wide projection in, the second half of the output-projection input out:
    equal to eager's `cat([attn, swiglu(mlp)])`."""
    dim, hidden = 3072, 9216
    mlp = _rows(1, tokens, hidden, dtype, gen, extra=3 * dim)
    attn = torch.randn(1, tokens, dim, generator=gen, device="cuda").to(dtype)
    joint = torch.empty(1, tokens, dim + hidden, device="cuda", dtype=dtype)
    joint[..., :dim].copy_(attn)
    swiglu(mlp, joint[..., dim:])
    assert bits_equal(joint, torch.cat([attn, reference.swiglu(mlp)], dim=-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("tokens", [1, 7, 4608])
@pytest.mark.parametrize("hidden", [10240, 12, 1028])
def test_two_projections_bit_exact(hidden, tokens, batch, dtype, gen):
    """Z-Image's feed-forward: a = w1(x) and b = w3(x) two tensors, b also a strided view."""
    rows = _rows(batch, tokens, hidden, dtype, gen)
    a, b = rows[..., :hidden].contiguous(), rows[..., hidden:].contiguous()
    assert decline_reason(a, None, b) is None and guards.pair(a, b)
    out = swiglu(a, None, b)
    assert out.shape == a.shape and bits_equal(out, reference.swiglu(a, b))
    assert bits_equal(swiglu(a, None, rows[..., hidden:]), reference.swiglu(rows))  # b strided
    into = torch.empty_like(a)
    swiglu(b, into, a)  # the operands' roles swapped, into a given tensor
    assert bits_equal(into, reference.swiglu(b, a))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_random_bit_patterns(dtype, gen):
    for _ in range(4):
        x = random_bits((3, 129, 2 * 1024), dtype, gen)
        assert bits_equal(swiglu(x), reference.swiglu(x))
        a, b = x.chunk(2, dim=-1)
        assert bits_equal(swiglu(a, None, b), reference.swiglu(a, b))


def test_every_bf16_value(gen):
    """silu(a) * b for all 65536 bf16 values of a, each against random b."""
    a = every_bit_pattern(torch.bfloat16, "cuda")
    b = torch.randn(a.numel(), generator=gen, device="cuda").to(torch.bfloat16)
    x = torch.cat([a.view(-1, 1024), b.view(-1, 1024)], dim=-1)
    assert bits_equal(swiglu(x), reference.swiglu(x))


def test_follows_current_stream_and_graph_capture(gen):
    x = _rows(1, 300, 9216, torch.bfloat16, gen)
    assert guards.plain(x)  # the self-check runs here
    assert_streams_and_graph_capture(lambda: swiglu(x), reference.swiglu(x))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tensors_on_a_device_other_than_the_current_one():
    x = torch.randn(2, 33, 2 * 1024, device="cuda:1").to(torch.bfloat16)
    assert_runs_on_its_tensors_device("swiglu", guards.plain, swiglu, reference.swiglu, x)


def _quantized_equals_torchao(x, prefix=None, b=None, granularity="row") -> bool:
    """The quantizing form's (bytes, scales) against torchao's quantization of eager's joint row."""
    from flux2_fused.ops import swiglu as op
    from flux2_fused.ops.float8_quant import reference as float8
    from flux2_fused.ops.float8_quant.selfcheck import same

    value = reference.swiglu(x) if b is None else reference.swiglu(x, b)
    joint = value if prefix is None else torch.cat([prefix, value], dim=-1)
    got = op.quantized(x, prefix=prefix, b=b, granularity=granularity)
    return got is not None and same(got, float8.quantize(joint, granularity))


@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize(
    ("dim", "hidden", "tokens"),
    [(3072, 9216, 4608), (6144, 18432, 4608), (3072, 9216, 37), (0, 9216, 4096), (0, 18432, 512), (8, 16, 5)],
)
def test_quantized_rows_equal_torchaos_quantization_of_eager(
    dim, hidden, tokens, batch, dtype, granularity, gen
):
    """A single block's [attention | swiglu(mlp)] (FLUX.2 klein's and dev's widths; dim 0: a
    feed-forward's swiglu alone), the MLP part a strided view of the projection, edge values in it
    (with one scale for the tensor their NaN makes every element NaN, so finite rows follow)."""
    x = _rows(batch, tokens, hidden, dtype, gen, extra=3 * max(dim, 8))
    prefix = (torch.randn(batch, tokens, dim, generator=gen, device="cuda") * 3).to(dtype) if dim else None
    assert _quantized_equals_torchao(x, prefix, granularity=granularity)
    if granularity == "tensor":
        assert _quantized_equals_torchao(x.nan_to_num(0.0, 0.0, 0.0), prefix, granularity=granularity)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("dim", "hidden", "extra"), [(4, 12, 12), (0, 16, 4), (8, 1024, 12)])
def test_quantized_rows_not_of_16_byte_vectors(dim, hidden, extra, dtype, gen):
    """Rows that are not whole 16-byte vectors (an odd multiple of 4 wide) or do not start on 16
    bytes (a view 8 or 24 bytes into its projection) take the quantizing kernel's 8-byte form, the
    models' rows its 16-byte one: the same bits either way."""
    x = _rows(2, 37, hidden, dtype, gen, extra=extra)
    prefix = (torch.randn(2, 37, dim, generator=gen, device="cuda") * 3).to(dtype) if dim else None
    assert _quantized_equals_torchao(x, prefix)


@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantized_two_projections_and_random_bits(dtype, granularity, gen):
    a, b = (random_bits((2, 300, 10240), dtype, gen) for _ in range(2))
    assert _quantized_equals_torchao(a, b=b, granularity=granularity)
    x, prefix = random_bits((2, 300, 2 * 9216), dtype, gen), random_bits((2, 300, 3072), dtype, gen)
    assert _quantized_equals_torchao(x, prefix, granularity=granularity)
    finite = (torch.randn(2, 300, 10240, generator=gen, device="cuda") * 3).to(dtype)
    assert _quantized_equals_torchao(finite, b=finite.flip(-1), granularity=granularity)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("dim", "tokens", "batch"), [(3072, 4608, 1), (0, 37, 2), (8, 5, 2)])
def test_joint_rows_and_their_amax_words(dim, tokens, batch, dtype, gen):
    """The joint form writes eager's [prefix | swiglu] bit for bit and each row's amax word (its
    largest magnitude's bits); the tensor's float8 from those words is torchao's."""
    from flux2_fused.ops.float8_quant import float8_quant
    from flux2_fused.ops.float8_quant import reference as float8
    from flux2_fused.ops.float8_quant.selfcheck import same
    from flux2_fused.ops.swiglu.launch import launch_joint

    x = _rows(batch, tokens, 9216, dtype, gen, extra=24).nan_to_num(0.0, 0.0, 0.0)
    prefix = (torch.randn(batch, tokens, dim, generator=gen, device="cuda") * 3).to(dtype) if dim else None
    joint, words = launch_joint(x, prefix)
    expected = reference.swiglu(x) if prefix is None else torch.cat([prefix, reference.swiglu(x)], dim=-1)
    assert joint.is_contiguous() and bits_equal(joint, expected)
    assert torch.equal(words, expected.abs().amax(-1).flatten().view(torch.int16).to(torch.int32))
    assert same(float8_quant(joint, "tensor", words), float8.quantize(expected, "tensor"))
