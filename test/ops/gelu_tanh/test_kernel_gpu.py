"""GPU tests: the gelu_tanh kernel equals eager bit for bit (run with `pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.ops import bits_equal, every_bit_pattern, random_bits
from flux2_fused.ops.gelu_tanh import OP, Config, concat, decline_reason, gelu_tanh, guards, reference

from ..conftest import assert_runs_on_its_tensors_device, assert_streams_and_graph_capture

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]


def _rows(batch: int, tokens: int, hidden: int, dtype: torch.dtype, gen: torch.Generator, extra: int = 0):
    """[B, S, H] (a view of a wider projection when extra > 0) across the tanh's whole range."""
    wide = torch.randn(batch, tokens, extra + hidden, generator=gen, device="cuda") * 4
    wide[:, 1::7] *= 30  # tanh saturates: gelu -> x, or -0
    wide[:, 2::7] *= 1e-4  # gelu ~ x / 2
    wide[:, 3::11, 5] = float("nan")
    wide[:, 4::13, 6] = float("inf")
    wide[:, 5::13, 7] = -float("inf")
    return wide.to(dtype)[..., extra:]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2**16), (64, 1024), (2, 32, 1024), (2, 8, 4096)], ids=str)
def test_every_bit_pattern(shape, dtype):
    """gelu_tanh is a unary function of a 16-bit input: equal on all 65536 inputs is equal everywhere
    (as one row, 16 passes of the row loop; as [S, H] rows; as batches)."""
    x = every_bit_pattern(dtype, "cuda").view(shape)
    assert decline_reason(x) is None
    assert bits_equal(gelu_tanh(x), reference.gelu_tanh(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("tokens", [1, 7, 513, 4608])
@pytest.mark.parametrize("hidden", [12288, 3072, 12, 1028, 4100])
def test_dense_projection_bit_exact(hidden, tokens, batch, dtype, gen):
    x = _rows(batch, tokens, hidden, dtype, gen)
    assert decline_reason(x) is None
    out = gelu_tanh(x)
    assert out.is_contiguous() and bits_equal(out, reference.gelu_tanh(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [3, 33])
def test_strided_rows(tokens, dtype, gen):
    """A view of a wider projection, batch 2 and an odd token count, 3-D and 2-D."""
    x = _rows(2, tokens, 1028, dtype, gen, extra=3 * 1024)
    assert x.stride(-2) == 3 * 1024 + 1028 and bits_equal(gelu_tanh(x), reference.gelu_tanh(x))
    rows_2d = x[1]
    assert bits_equal(gelu_tanh(rows_2d), reference.gelu_tanh(rows_2d))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [3, 4608])
def test_single_block_layout_into_half_of_the_buffer(tokens, dtype, gen):
    """FLUX.1-dev's single block: the MLP projection in, the second half of the output-projection
    input out: equal to eager's `cat([attn, gelu(mlp)], dim=2)`, and to `concat`."""
    dim, hidden = 3072, 12288
    mlp = _rows(1, tokens, hidden, dtype, gen)
    attn = torch.randn(1, tokens, dim, generator=gen, device="cuda").to(dtype)
    expected = torch.cat([attn, reference.gelu_tanh(mlp)], dim=2)
    joint = torch.empty(1, tokens, dim + hidden, device="cuda", dtype=dtype)
    joint[..., :dim].copy_(attn)
    gelu_tanh(mlp, joint[..., dim:])
    assert bits_equal(joint, expected)
    assert guards.plain(mlp)  # self-checked: concat takes the kernel
    assert bits_equal(concat(attn, mlp), expected)
    assert bits_equal(concat(attn, mlp, enabled=False), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_bit_patterns(dtype, gen):
    for _ in range(4):
        x = random_bits((3, 129, 3072), dtype, gen)
        assert bits_equal(gelu_tanh(x), reference.gelu_tanh(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_self_check_passes(dtype):
    passed, detail = OP.self_check(torch.device("cuda"), Config(dtype))
    assert passed, detail
    assert "65536" in detail


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tensors_on_a_device_other_than_the_current_one():
    x = torch.randn(2, 33, 1024, device="cuda:1").to(torch.bfloat16)
    assert_runs_on_its_tensors_device("gelu_tanh", guards.plain, gelu_tanh, reference.gelu_tanh, x)


def test_validated_op_raises_on_the_gpu():
    x = torch.randn(2, 5, 8, device="cuda")
    with pytest.raises(TypeError, match="is not supported"):
        gelu_tanh(x)
    joint = torch.empty(2, 5, 16, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out shares storage with x"):
        gelu_tanh(joint[..., :8], joint[..., 8:])
    with pytest.raises(ValueError, match="out shape"):
        gelu_tanh(joint[..., :8], torch.empty(2, 5, 4, device="cuda", dtype=torch.bfloat16))


def test_follows_current_stream_and_graph_capture(gen):
    """The launch goes on the current stream, and into a CUDA graph while one is captured."""
    x = _rows(1, 300, 12288, torch.bfloat16, gen)
    assert guards.plain(x)  # the self-check runs here
    assert_streams_and_graph_capture(lambda: gelu_tanh(x), reference.gelu_tanh(x))


@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("dim", "hidden", "tokens"), [(3072, 12288, 4608), (0, 12288, 4096), (3072, 12288, 3)]
)
def test_quantized_rows_equal_torchaos_quantization_of_eager(dim, hidden, tokens, dtype, granularity, gen):
    """FLUX.1's single block, [attention | gelu(mlp)], and its feed-forward's gelu alone (dim 0), as
    torchao's float8 of eager's row (a scale a row, or the tensor's); then random bit patterns."""
    from flux2_fused.ops import gelu_tanh as op
    from flux2_fused.ops.float8_quant import reference as float8
    from flux2_fused.ops.float8_quant.selfcheck import same

    for x in (
        (torch.randn(2, tokens, hidden, generator=gen, device="cuda") * 4).to(dtype),
        random_bits((2, tokens, hidden), dtype, gen),
    ):
        prefix = (torch.randn(2, tokens, dim, generator=gen, device="cuda") * 3).to(dtype) if dim else None
        joint = reference.gelu_tanh(x) if prefix is None else torch.cat([prefix, reference.gelu_tanh(x)], -1)
        got = op.quantized(x, prefix=prefix, granularity=granularity)
        assert same(got, float8.quantize(joint, granularity))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("dim", "hidden", "offset"), [(4, 12, 0), (0, 16, 4), (8, 1024, 12)])
def test_quantized_rows_not_of_16_byte_vectors(dim, hidden, offset, dtype, gen):
    """Rows that are not whole 16-byte vectors (an odd multiple of 4 wide) or do not start on 16
    bytes (a view 8 or 24 bytes into a wider buffer) take the quantizing kernel's 8-byte form: the
    same bits as the 16-byte one gives the models' rows."""
    from flux2_fused.ops import gelu_tanh as op
    from flux2_fused.ops.float8_quant import reference as float8
    from flux2_fused.ops.float8_quant.selfcheck import same

    x = (torch.randn(2, 37, offset + hidden, generator=gen, device="cuda") * 4).to(dtype)[..., offset:]
    prefix = (torch.randn(2, 37, dim, generator=gen, device="cuda") * 3).to(dtype) if dim else None
    joint = reference.gelu_tanh(x) if prefix is None else torch.cat([prefix, reference.gelu_tanh(x)], -1)
    assert same(op.quantized(x, prefix=prefix), float8.quantize(joint, "row"))
