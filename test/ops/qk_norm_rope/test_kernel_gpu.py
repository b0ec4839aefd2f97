"""GPU tests: the attention-prologue kernel's q, k and v equal eager bit for bit (`pytest -m gpu`)."""

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


def _double_block(sizes, heads, batch, dtype, gen):
    """q, k (segments with their own weights) and v of a double block's text and image rows."""
    q = [Segment(_heads(batch, n, heads, dtype, gen), _weight(dtype, gen)) for n in sizes]
    k = [Segment(_heads(batch, n, heads, dtype, gen), _weight(dtype, gen)) for n in sizes]
    v = [_heads(batch, n, heads, dtype, gen) for n in sizes]
    return q, k, v


def _assert_equal(got, expected) -> None:
    assert len(got) == len(expected) == 3
    for name, a, b in zip("qkv", got, expected, strict=True):
        if b is None:
            assert a is None, name
            continue
        assert a.is_contiguous() and a.shape == b.shape and a.dtype == b.dtype, name
        assert bits_equal(a, b), f"{name} differs from eager"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("heads", [1, 3, 24, 48])
@pytest.mark.parametrize(("txt", "img"), [(1, 7), (77, 513), (512, 4096)])
def test_double_block_layout_bit_exact(txt, img, heads, batch, dtype, gen):
    if heads * (txt + img) * batch > 48 * 4608:
        pytest.skip("larger than dev's prologue")
    q, k, v = _double_block((txt, img), heads, batch, dtype, gen)
    cos, sin = rope_tables(txt + img, torch.device("cuda"), gen)
    assert decline_reason(q, k, cos, sin, v) is None
    _assert_equal(qk_norm_rope(q, k, cos, sin, v=v), reference.prologue(q, k, cos, sin, 1e-6, v))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_double_block_without_v_and_one_segment_with_v(dtype, gen):
    """Both optional parts of the launch on their own: two segments without v; one segment with v
    (a copy of it, as `cat` of one tensor gives)."""
    q, k, v = _double_block((13, 50), 5, 2, dtype, gen)
    cos, sin = rope_tables(63, torch.device("cuda"), gen)
    _assert_equal(qk_norm_rope(q, k, cos, sin), reference.prologue(q, k, cos, sin, 1e-6))
    cos, sin = cos[13:].contiguous(), sin[13:].contiguous()
    got = qk_norm_rope(q[1:], k[1:], cos, sin, v=v[1:])
    _assert_equal(got, reference.prologue(q[1:], k[1:], cos, sin, 1e-6, v[1:]))
    assert got[2].data_ptr() != v[1].data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("heads", [5, 24, 48])
@pytest.mark.parametrize("tokens", [1, 7, 4608])
def test_single_block_layout_bit_exact(tokens, heads, batch, dtype, gen):
    """q and k strided chunks of one wide projection (the single block's), no v."""
    wide = _heads(batch, tokens, 2 * heads, dtype, gen, width=4)
    q = [Segment(wide[:, :, :heads], _weight(dtype, gen))]
    k = [Segment(wide[:, :, heads:], _weight(dtype, gen))]
    cos, sin = rope_tables(tokens, torch.device("cuda"), gen)
    got = qk_norm_rope(q, k, cos, sin)
    assert got[0].shape == (batch, tokens, heads, HEAD_DIM)
    _assert_equal(got, reference.prologue(q, k, cos, sin, 1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_random_bit_patterns(dtype, gen):
    """Every bit pattern in q, k, v and the weights (subnormals, NaN, Inf), finite tables of any exponent."""
    txt, img, heads = 100, 157, 5
    for _ in range(4):
        q, k, v = ([random_bits((2, n, heads, HEAD_DIM), dtype, gen) for n in (txt, img)] for _ in range(3))
        q = [Segment(x, random_bits((HEAD_DIM,), dtype, gen)) for x in q]
        k = [Segment(x, random_bits((HEAD_DIM,), dtype, gen)) for x in k]
        tokens = txt + img
        exponents = torch.randint(-80, 80, (tokens, HEAD_DIM), generator=gen, device="cuda").float()
        cos = torch.ldexp(torch.rand(tokens, HEAD_DIM, generator=gen, device="cuda") - 0.5, exponents)
        sin = torch.ldexp(torch.rand(tokens, HEAD_DIM, generator=gen, device="cuda") - 0.5, exponents.flip(0))
        _assert_equal(qk_norm_rope(q, k, cos, sin, v=v), reference.prologue(q, k, cos, sin, 1e-6, v))


def test_subnormal_squares_follow_aten(gen):
    """bf16 heads of ~1e-21 have squares below fp32's normal range, where fma(x, x, s) and
    s + x * x round differently; a subnormal eps keeps the difference visible in the output."""
    q, k = (
        [
            Segment(
                (torch.randn(1, 64, 4, HEAD_DIM, generator=gen, device="cuda") * 1e-21).to(torch.bfloat16),
                _weight(torch.bfloat16, gen),
            )
        ]
        for _ in range(2)
    )
    cos, sin = rope_tables(64, torch.device("cuda"), gen)
    _assert_equal(qk_norm_rope(q, k, cos, sin, 1e-45), reference.prologue(q, k, cos, sin, 1e-45))


def test_eps_reaches_the_norm(gen):
    q, k, v = _double_block((3, 6), 2, 1, torch.bfloat16, gen)
    q = [Segment(s.x * 1e-4, s.weight) for s in q]
    cos, sin = rope_tables(9, torch.device("cuda"), gen)
    for eps in (1e-6, 1e-2):
        _assert_equal(qk_norm_rope(q, k, cos, sin, eps, v), reference.prologue(q, k, cos, sin, eps, v))


def test_follows_current_stream_and_graph_capture(gen):
    q, k, v = _double_block((40, 260), 24, 1, torch.bfloat16, gen)
    cos, sin = rope_tables(300, torch.device("cuda"), gen)
    assert guards.segment(q[0].x, q[0].weight, cos, sin)  # self-check runs here
    expected = reference.prologue(q, k, cos, sin, 1e-6, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = qk_norm_rope(q, k, cos, sin, v=v)
    torch.cuda.current_stream().wait_stream(side)
    _assert_equal(out, expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = qk_norm_rope(q, k, cos, sin, v=v)
    for t in g_out:
        t.fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    _assert_equal(g_out, expected)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tensors_on_a_device_other_than_the_current_one():
    other = torch.device("cuda", 1)
    with torch.cuda.device(0):
        gen1 = torch.Generator(device=other).manual_seed(3)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen1, device=other).to(torch.bfloat16)

        q = [Segment(randn(2, n, 4, HEAD_DIM), randn(HEAD_DIM)) for n in (5, 28)]
        k = [Segment(randn(2, n, 4, HEAD_DIM), randn(HEAD_DIM)) for n in (5, 28)]
        v = [randn(2, n, 4, HEAD_DIM) for n in (5, 28)]
        cos, sin = rope_tables(33, other, gen1)
        assert guards.segment(q[0].x, q[0].weight, cos, sin)  # the self-check for cuda:1 runs here
        records = {key[:3]: record for key, record in self_check_records().items()}
        assert records[("qk_norm_rope", "cuda:1", "head_dim=128 bfloat16")].passed
        out = qk_norm_rope(q, k, cos, sin, v=v)
        assert torch.cuda.current_device() == 0 and all(t.device == other for t in out)
        _assert_equal(out, reference.prologue(q, k, cos, sin, 1e-6, v))
