"""GPU tests: the attention-prologue kernel equals eager bit for bit (run with `pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.ops import bits_equal, random_bits, self_check_records
from flux2_fused.ops.qk_norm_rope import HEAD_DIM, Segment, decline_reason, guards, qk_norm_rope, reference
from flux2_fused.ops.qk_norm_rope.selfcheck import rope_tables

pytestmark = pytest.mark.gpu


def _heads(batch: int, tokens: int, heads: int, dtype: torch.dtype, gen: torch.Generator, width: int = 1):
    """[B, S, H, 128] rows with scaled, constant, zero and non-finite heads mixed in; width > 1 makes
    it a chunk of a wider projection, as in the single block."""
    wide = torch.randn(batch, tokens, width * heads * HEAD_DIM, generator=gen, device="cuda").to(dtype)
    x = wide[..., : heads * HEAD_DIM].unflatten(-1, (heads, HEAD_DIM))
    x[:, 1::5, ::2] *= 1e2 if dtype == torch.float16 else 1e18
    x[:, 2::5, 1::2] *= 1e-3 if dtype == torch.float16 else 1e-20  # bf16: squares below fp32's normal range
    x[:, 3::7, 0] = x[:, 3::7, 0, :1]  # constant heads
    x[:, 4::11, -1] = 0.0
    x[:, 5::13, 0, 3] = float("nan")
    x[:, 6::17, -1, 9] = float("inf")
    return x


def _weight(dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(HEAD_DIM, generator=gen, device="cuda").to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("heads", [1, 3, 24, 48])
@pytest.mark.parametrize(("txt", "img"), [(1, 7), (77, 513), (512, 4096)])
def test_double_block_layout_bit_exact(txt, img, heads, batch, dtype, gen):
    if heads * (txt + img) * batch > 48 * 4608:
        pytest.skip("larger than dev's prologue")
    rows = [Segment(_heads(batch, txt, heads, dtype, gen), _weight(dtype, gen))]
    rows.append(Segment(_heads(batch, img, heads, dtype, gen), _weight(dtype, gen)))
    cos, sin = rope_tables(txt + img, torch.device("cuda"), gen)
    assert decline_reason(rows, cos, sin) is None
    assert bits_equal(qk_norm_rope(rows, cos, sin), reference.qk_norm_rope(rows, cos, sin, 1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("tokens", [1, 7, 4608])
def test_single_block_layout_bit_exact(tokens, batch, dtype, gen):
    heads = 24
    rows = [Segment(_heads(batch, tokens, heads, dtype, gen, width=5), _weight(dtype, gen))]
    cos, sin = rope_tables(tokens, torch.device("cuda"), gen)
    out = qk_norm_rope(rows, cos, sin)
    assert out.is_contiguous() and out.shape == (batch, tokens, heads, HEAD_DIM)
    assert bits_equal(out, reference.qk_norm_rope(rows, cos, sin, 1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_random_bit_patterns(dtype, gen):
    """Every bit pattern in x and the weight (subnormals, NaN, Inf), finite tables of any exponent."""
    tokens, heads = 257, 5
    for _ in range(4):
        x = random_bits((2, tokens, heads, HEAD_DIM), dtype, gen)
        weight = random_bits((HEAD_DIM,), dtype, gen)
        exponents = torch.randint(-80, 80, (tokens, HEAD_DIM), generator=gen, device="cuda").float()
        cos = torch.ldexp(torch.rand(tokens, HEAD_DIM, generator=gen, device="cuda") - 0.5, exponents)
        sin = torch.ldexp(torch.rand(tokens, HEAD_DIM, generator=gen, device="cuda") - 0.5, exponents.flip(0))
        rows = [Segment(x, weight)]
        assert bits_equal(qk_norm_rope(rows, cos, sin), reference.qk_norm_rope(rows, cos, sin, 1e-6))


def test_subnormal_squares_follow_aten(gen):
    """bf16 heads of ~1e-21 have squares below fp32's normal range, where fma(x, x, s) and
    s + x * x round differently; a subnormal eps keeps the difference visible in the output."""
    x = (torch.randn(1, 64, 4, HEAD_DIM, generator=gen, device="cuda") * 1e-21).to(torch.bfloat16)
    rows = [Segment(x, _weight(torch.bfloat16, gen))]
    cos, sin = rope_tables(64, torch.device("cuda"), gen)
    assert bits_equal(qk_norm_rope(rows, cos, sin, 1e-45), reference.qk_norm_rope(rows, cos, sin, 1e-45))


def test_eps_reaches_the_norm(gen):
    x = _heads(1, 9, 2, torch.bfloat16, gen) * 1e-4
    rows = [Segment(x, _weight(torch.bfloat16, gen))]
    cos, sin = rope_tables(9, torch.device("cuda"), gen)
    for eps in (1e-6, 1e-2):
        assert bits_equal(qk_norm_rope(rows, cos, sin, eps), reference.qk_norm_rope(rows, cos, sin, eps))


def test_follows_current_stream_and_graph_capture(gen):
    rows = [Segment(_heads(1, 300, 24, torch.bfloat16, gen), _weight(torch.bfloat16, gen))]
    cos, sin = rope_tables(300, torch.device("cuda"), gen)
    assert guards.segment(rows[0].x, rows[0].weight, cos, sin)  # self-check runs here
    expected = reference.qk_norm_rope(rows, cos, sin, 1e-6)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = qk_norm_rope(rows, cos, sin)
    torch.cuda.current_stream().wait_stream(side)
    assert bits_equal(out, expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = qk_norm_rope(rows, cos, sin)
    g_out.fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    assert bits_equal(g_out, expected)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tensors_on_a_device_other_than_the_current_one():
    other = torch.device("cuda", 1)
    with torch.cuda.device(0):
        gen1 = torch.Generator(device=other).manual_seed(3)
        x = torch.randn(2, 33, 4, HEAD_DIM, generator=gen1, device=other).to(torch.bfloat16)
        weight = torch.randn(HEAD_DIM, generator=gen1, device=other).to(torch.bfloat16)
        cos, sin = rope_tables(33, other, gen1)
        assert guards.segment(x, weight, cos, sin)  # the self-check for cuda:1 runs here
        records = {key[:3]: record for key, record in self_check_records().items()}
        assert records[("qk_norm_rope", "cuda:1", "head_dim=128 bfloat16")].passed
        out = qk_norm_rope([Segment(x, weight)], cos, sin)
        assert torch.cuda.current_device() == 0 and out.device == other
        assert bits_equal(out, reference.qk_norm_rope([Segment(x, weight)], cos, sin, 1e-6))
