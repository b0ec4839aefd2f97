"""GPU tests: the float8 quantization kernels equal torchao's eager chain byte for byte (run with
`pytest -m gpu`): scales per row and per tensor, bf16 and fp16, the widths of FLUX's and Z-Image's
Linear inputs, edge rows, every bf16 value, every value under every scale it can have, random bit
patterns, streams and graph capture."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.ops import every_bit_pattern, random_bits
from flux2_fused.ops.float8_quant import decline_reason, float8_quant, guards, reference
from flux2_fused.ops.float8_quant.selfcheck import edge_rows, same

pytestmark = pytest.mark.gpu
GRANULARITIES = ["row", "tensor"]
DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("batch", "tokens"), [(1, 1), (1, 4608), (2, 37)])
@pytest.mark.parametrize("cols", [8, 3072, 3840, 9216, 10240, 24576])
def test_rows_equal_torchaos_chain(cols, batch, tokens, dtype, granularity, gen):
    x = (torch.randn(batch, tokens, cols, generator=gen, device="cuda") * 4).to(dtype)
    assert decline_reason(x, granularity) is None
    assert same(float8_quant(x, granularity), reference.quantize(x, granularity))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "cols"), [(4608, 3072), (4608, 12288), (37, 40), (3, 30720)])
def test_a_tensor_scale_from_the_words_a_kernel_left(tokens, cols, dtype, gen):
    """Per tensor, the amax words given in place of the first launch: one a row, as the row-wise
    joint form leaves them, or any other count holding the same max (here one word); K past the
    widest row a block holds."""
    x = (torch.randn(2, tokens, cols, generator=gen, device="cuda") * 4).to(dtype)
    words = x.abs().amax(-1).flatten().view(torch.int16).to(torch.int32)
    expected = reference.quantize(x, "tensor")
    assert decline_reason(x, "tensor", words) is None
    assert same(float8_quant(x, "tensor", words), expected)
    assert same(float8_quant(x, "tensor", words.max().reshape(1)), expected)
    x[1, 2, 3] = float("nan")
    words = x.abs().amax(-1).flatten().view(torch.int16).to(torch.int32) & 0x7FFF
    assert same(float8_quant(x, "tensor", words), reference.quantize(x, "tensor"))


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_edge_rows(dtype, granularity, gen):
    """Zero, tiny, subnormal, at and past 448, huge, NaN and +-Inf rows (with a tensor scale the NaN
    rows make every element NaN: eager's bits too)."""
    x = (torch.randn(2, 12, 1040, generator=gen, device="cuda") * 3).to(dtype)
    edge_rows(x)
    assert same(float8_quant(x, granularity), reference.quantize(x, granularity))
    x[0, 5:8] = 1.0  # no NaN or Inf left: a finite tensor scale
    assert same(float8_quant(x, granularity), reference.quantize(x, granularity))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_every_bf16_value(granularity):
    """All 65536 bf16 patterns as 64 rows of 1024, each row's scale its own; then every finite one
    under one scale."""
    x = every_bit_pattern(torch.bfloat16, "cuda").view(64, 1024)
    assert same(float8_quant(x, granularity), reference.quantize(x, granularity))
    finite = x.flatten()[x.flatten().isfinite()]
    finite = finite[: finite.numel() // 8 * 8].view(-1, 8)
    assert same(float8_quant(finite, granularity), reference.quantize(finite, granularity))


def rows_under_amax(amaxes: torch.Tensor, cols: int) -> torch.Tensor:
    """int16 bit rows: for each magnitude a (bits, ascending), every value of magnitude <= a of both
    signs, cols - 1 of them a row after a itself (which makes a each row's amax), the last row
    padded with a."""
    per_row = cols - 1
    counts = 2 * (amaxes + 1)  # the values of magnitude 0..a, + and -
    rows = (counts + per_row - 1) // per_row
    row_amax = torch.repeat_interleave(amaxes, rows)
    first = torch.repeat_interleave(torch.cumsum(rows, 0) - rows, rows)
    within = torch.arange(row_amax.numel(), device=amaxes.device) - first
    idx = within[:, None] * per_row + torch.arange(per_row, device=amaxes.device)
    bits = torch.where(idx < 2 * (row_amax[:, None] + 1), (idx >> 1) | ((idx & 1) << 15), row_amax[:, None])
    return torch.cat([row_amax[:, None], bits], dim=1).to(torch.int32).to(torch.int16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_value_under_every_scale_it_can_have(dtype):
    """Each finite or infinite amax a of the dtype, and under its scale every value x with |x| <= a:
    the kernel's short path (a reciprocal corrected to the exact quotient, the hardware's conversion)
    and its long path together equal torchao's chain on the whole domain they serve (2^30 pairs)."""
    top = int(torch.tensor(float("inf"), dtype=dtype).view(torch.int16))  # +Inf's bits
    magnitudes = torch.arange(top + 1, device="cuda", dtype=torch.int64)
    for chunk in magnitudes.flip(0).split(1024):
        x = rows_under_amax(chunk.flip(0), 8192).view(dtype)
        assert same(float8_quant(x, "row"), reference.quantize(x, "row")), (int(chunk[-1]), int(chunk[0]))


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_bit_patterns(dtype, granularity, gen):
    for _ in range(4):
        x = random_bits((3, 129, 1024), dtype, gen)
        assert same(float8_quant(x, granularity), reference.quantize(x, granularity))


def test_follows_current_stream_and_graph_capture(gen):
    x = (torch.randn(2, 300, 3072, generator=gen, device="cuda") * 4).to(torch.bfloat16)
    assert guards.decline_reason(x) is None  # the self-check runs here
    for granularity in GRANULARITIES:
        expected = reference.quantize(x, granularity)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got = float8_quant(x, granularity)
        torch.cuda.current_stream().wait_stream(side)
        assert same(got, expected)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = float8_quant(x, granularity)
        for t in captured:
            t.view(torch.uint8).fill_(0)
        graph.replay()
        assert same(captured, expected)
