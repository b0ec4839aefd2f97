"""GPU tests: the attention-prologue kernel's q, k and v equal eager bit for bit (`pytest -m gpu`), in
FLUX.2's mode and in the upcast mode (FLUX.3: norm and RoPE on q.float() with a float32 weight)."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.ops import bits_equal, random_bits, self_check_records
from flux2_fused.ops.qk_norm_rope import (
    HEAD_DIM,
    OP,
    Config,
    Segment,
    apply,
    decline_reason,
    fused,
    guards,
    qk_norm_rope,
    reference,
)
from flux2_fused.ops.qk_norm_rope.selfcheck import float32_bits, rope_tables

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


def _fp32_weight(gen: torch.Generator) -> torch.Tensor:
    """The upcast mode's weight: float32 of full precision, drawn fresh."""
    return torch.randn(HEAD_DIM, generator=gen, device="cuda") * 2


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


@pytest.mark.parametrize("upcast", [False, True])
def test_follows_current_stream_and_graph_capture(upcast, gen):
    q, k, v = _double_block((40, 260), 24, 1, torch.bfloat16, gen)
    if upcast:
        q, k = ([Segment(s.x, _fp32_weight(gen)) for s in rows] for rows in (q, k))
    cos, sin = rope_tables(300, torch.device("cuda"), gen)
    assert guards.segment_guard(upcast)(q[0].x, q[0].weight, cos, sin)  # self-check runs here
    expected = reference.prologue(q, k, cos, sin, 1e-6, v, upcast=upcast)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = qk_norm_rope(q, k, cos, sin, v=v, upcast=upcast)
    torch.cuda.current_stream().wait_stream(side)
    _assert_equal(out, expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = qk_norm_rope(q, k, cos, sin, v=v, upcast=upcast)
    for t in g_out:
        t.fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    _assert_equal(g_out, expected)


@pytest.mark.parametrize(
    "mode",
    [{}, {"upcast": True}, {"rotation": "addcmul"}, {"rotation": "complex", "norm": "mean"}],
    ids=["aten", "upcast", "addcmul", "complex"],
)
def test_a_token_split_over_blocks_is_eager(mode, gen):
    """A token's row pairs dealt to the warps of one to sixteen blocks (and of the kernel's own
    choice, which splits a grid too small to fill the GPU): the same bits, with v and two segments,
    with heads odd (a pair's second half past the end), at batch 2; a split past the entry's limit
    is refused before anything launches."""
    from flux2_fused.ops.qk_norm_rope.launch import launch

    for heads, with_v in ((25, True), (24, False), (3, True)):
        q, k, v = _double_block((37, 90), heads, 2, torch.bfloat16, gen)
        if mode.get("upcast"):
            q, k = ([Segment(s.x, _fp32_weight(gen)) for s in rows] for rows in (q, k))
        v = v if with_v else None
        cos, sin = rope_tables(127, torch.device("cuda"), gen)
        expected = reference.prologue(q, k, cos, sin, 1e-6, v, **mode)
        poison = [torch.full_like(t, float("nan")) for t in expected if t is not None]
        del poison  # freed blocks of the outputs' size hold NaN, not eager's bits
        for parts in (0, 1, 2, 3, 5, 16):
            got = launch(q, k, cos, sin, 1e-6, v, parts=parts, **mode)
            _assert_equal(got, expected)
            for t in got:  # so no later launch's outputs can be memory holding eager's bits
                if t is not None:
                    t.fill_(float("nan"))
    with pytest.raises(Exception, match="parts"):
        launch(q, k, cos, sin, 1e-6, v, parts=17, **mode)


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


# The upcast mode (FLUX.3): `norm(x.float())` with a float32 weight, RoPE in fp32, one rounding.


def _assert_upcast(q, k, cos, sin, eps=1e-6, v=None):
    """The kernel in the upcast mode equals the upcast eager chain; both modes' inputs accepted."""
    assert decline_reason(q, k, cos, sin, v, upcast=True) is None
    got = qk_norm_rope(q, k, cos, sin, eps, v, upcast=True)
    _assert_equal(got, reference.prologue(q, k, cos, sin, eps, v, upcast=True))
    return got


def _extreme_heads(x: torch.Tensor) -> None:
    """Heads at the dtype's largest and smallest magnitudes: squares that overflow fp32 (bf16), and
    subnormal 16-bit inputs."""
    finfo = torch.finfo(x.dtype)
    x[:, 0, -1] = finfo.max
    x[:, 0, -1, 1::2] = -finfo.max / 3
    x[:, -1, 0] = finfo.smallest_normal * torch.arange(HEAD_DIM, device=x.device).to(x.dtype) / 64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("tokens", [1, 7, 512 + 7, 4096 + 512 + 7])
@pytest.mark.parametrize("layout", ["projections", "qkv"])
def test_upcast_flux3_prologue_bit_exact(layout, tokens, batch, dtype, gen):
    """FLUX.3's one segment of 24 heads: q and k views of their own projections, or chunks of one
    fused qkv projection; edge heads (scaled, constant, zero, NaN, Inf, extreme); fresh fp32 weights."""
    heads = 24
    if layout == "projections":
        qx, kx = _heads(batch, tokens, heads, dtype, gen), _heads(batch, tokens, heads, dtype, gen)
    else:
        qkv = _heads(batch, tokens, 3 * heads, dtype, gen)
        qx, kx = qkv[:, :, :heads], qkv[:, :, heads : 2 * heads]
    _extreme_heads(qx)
    cos, sin = rope_tables(tokens, torch.device("cuda"), gen)
    q, k = [Segment(qx, _fp32_weight(gen))], [Segment(kx, _fp32_weight(gen))]
    got = _assert_upcast(q, k, cos, sin)
    assert got[0].shape == (batch, tokens, heads, HEAD_DIM) and got[2] is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [3, 24])
@pytest.mark.parametrize(("txt", "img"), [(1, 7), (77, 513 + 4096)])
def test_upcast_two_segments_with_v_bit_exact(txt, img, heads, dtype, gen):
    """The launch's general layout in the upcast mode: two segments with their own float32 weights,
    and v's concat."""
    q, k, v = _double_block((txt, img), heads, 2, dtype, gen)
    q, k = ([Segment(s.x, _fp32_weight(gen)) for s in rows] for rows in (q, k))
    cos, sin = rope_tables(txt + img, torch.device("cuda"), gen)
    _assert_upcast(q, k, cos, sin, v=v)
    _assert_upcast(q, k, cos, sin)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_upcast_random_bit_patterns(dtype, gen):
    """Every 16-bit pattern in q, k and v, every float32 pattern in the weights (subnormal, NaN, Inf),
    finite tables of any exponent; one segment (FLUX.3's) and two."""
    txt, img, heads = 100, 157, 5
    tokens = txt + img
    for _ in range(4):
        q, k, v = ([random_bits((2, n, heads, HEAD_DIM), dtype, gen) for n in (txt, img)] for _ in range(3))
        q = [Segment(x, float32_bits((HEAD_DIM,), gen)) for x in q]
        k = [Segment(x, float32_bits((HEAD_DIM,), gen)) for x in k]
        exponents = torch.randint(-80, 80, (tokens, HEAD_DIM), generator=gen, device="cuda").float()
        cos = torch.ldexp(torch.rand(tokens, HEAD_DIM, generator=gen, device="cuda") - 0.5, exponents)
        sin = torch.ldexp(torch.rand(tokens, HEAD_DIM, generator=gen, device="cuda") - 0.5, exponents.flip(0))
        _assert_upcast(q, k, cos, sin, v=v)
        _assert_upcast(q[1:], k[1:], cos[txt:].contiguous(), sin[txt:].contiguous())


def test_upcast_subnormal_squares_follow_aten(gen):
    """As test_subnormal_squares_follow_aten, for aten's float instantiation of the norm kernel (a
    separately compiled function): squares of bf16 heads of ~1e-21 lie below fp32's normal range."""
    q, k = (
        [
            Segment(
                (torch.randn(1, 64, 4, HEAD_DIM, generator=gen, device="cuda") * 1e-21).to(torch.bfloat16),
                _fp32_weight(gen),
            )
        ]
        for _ in range(2)
    )
    cos, sin = rope_tables(64, torch.device("cuda"), gen)
    _assert_upcast(q, k, cos, sin, 1e-45)


def test_upcast_eps_reaches_the_norm(gen):
    q, k, _ = _double_block((3, 6), 2, 1, torch.bfloat16, gen)
    q = [Segment(s.x * 1e-4, _fp32_weight(gen)) for s in q]
    k = [Segment(s.x, _fp32_weight(gen)) for s in k]
    cos, sin = rope_tables(9, torch.device("cuda"), gen)
    for eps in (1e-6, 1e-2):
        _assert_upcast(q, k, cos, sin, eps)


def test_upcast_differs_from_flux2s_mode(gen):
    """The modes are different functions (the upcast mode keeps the norm's output in fp32): on the same
    rows and weight (one representable in bf16), most outputs differ somewhere, and each mode equals
    its own eager chain."""
    x = _heads(2, 33, 8, torch.bfloat16, gen)
    w = _fp32_weight(gen).to(torch.bfloat16)
    cos, sin = rope_tables(33, torch.device("cuda"), gen)
    flux2 = qk_norm_rope([Segment(x, w)], [Segment(x, w)], cos, sin)
    flux3 = qk_norm_rope([Segment(x, w.float())], [Segment(x, w.float())], cos, sin, upcast=True)
    _assert_equal(flux2, reference.prologue([Segment(x, w)], [Segment(x, w)], cos, sin))
    _assert_equal(
        flux3, reference.prologue([Segment(x, w.float())], [Segment(x, w.float())], cos, sin, upcast=True)
    )
    assert not bits_equal(flux2[0], flux3[0])


def test_upcast_equals_diffusers_flux3_attention(monkeypatch, gen):
    """diffusers' own Flux3Attention on the GPU (bf16 projections, float32 norms as from_pretrained
    keeps them): the q and k its processor hands to attention are the kernel's, bit for bit."""
    flux3 = pytest.importorskip("diffusers.models.transformers.transformer_flux3")
    heads, tokens = 24, 4096 + 512 + 7
    attn = flux3.Flux3Attention(query_dim=heads * HEAD_DIM, heads=heads, dim_head=HEAD_DIM)
    attn = attn.to("cuda", torch.bfloat16)
    attn.norm_q.float()
    attn.norm_k.float()
    with torch.no_grad():
        attn.norm_q.weight.copy_(_fp32_weight(gen))
        attn.norm_k.weight.copy_(_fp32_weight(gen))
    seen = {}

    def attention(query, key, value, **_):
        seen.update(query=query, key=key)
        return torch.zeros_like(value)

    monkeypatch.setattr(flux3, "dispatch_attention_fn", attention)
    ids = torch.randint(0, 512, (tokens, 4), generator=gen, device="cuda")
    rotary = flux3.Flux3PosEmbed(theta=10000, axes_dim=[32, 32, 32, 32])(ids)
    h = torch.randn(2, tokens, heads * HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        attn(h, image_rotary_emb=rotary)
        query, key = (proj(h).unflatten(-1, (heads, -1)) for proj in (attn.to_q, attn.to_k))
        q, k = [Segment(query, attn.norm_q.weight)], [Segment(key, attn.norm_k.weight)]
        got = _assert_upcast(q, k, *rotary)
    assert torch.equal(got[0], seen["query"]) and torch.equal(got[1], seen["key"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_upcast_self_check_verdicts_and_fallback(dtype, gen):
    """The upcast mode has its own verdict per dtype (the entry point then launches the kernel), and
    `flux2-fused verify`'s configurations pass; a float32 weight 8 bytes off 16-byte alignment (aten's
    float kernel would take its other reduction) declines, and `apply` runs the eager chain."""
    q, k, _ = _double_block((5, 40), 3, 2, dtype, gen)
    q, k = [Segment(q[1].x, _fp32_weight(gen))], [Segment(k[1].x, _fp32_weight(gen))]
    cos, sin = rope_tables(40, torch.device("cuda"), gen)
    assert guards.upcast_segment(q[0].x, q[0].weight, cos, sin)  # the upcast self-check runs here
    name = str(dtype).removeprefix("torch.")
    records = {key[:3]: record for key, record in self_check_records().items()}
    assert records[("qk_norm_rope", "cuda:0", f"head_dim=128 {name} upcast")].passed
    assert fused(q, k, cos, sin, 1e-6, upcast=True) is not None
    for config in (Config(dtype), Config(dtype, upcast=True)):
        passed, detail = OP.self_check(torch.device("cuda"), config)
        assert passed, detail
    off = torch.empty(HEAD_DIM + 2, device="cuda")[2:]
    off.copy_(q[0].weight)
    shifted = [Segment(q[0].x, off)]
    assert decline_reason(shifted, k, cos, sin, upcast=True) == "weight data pointer is not 16-byte aligned"
    assert fused(shifted, k, cos, sin, 1e-6, upcast=True) is None
    got = apply(shifted, k, cos, sin, 1e-6, upcast=True)
    _assert_equal(got, reference.prologue(shifted, k, cos, sin, 1e-6, upcast=True))


# ComfyUI's rotations ("addcmul": its torch code, "kitchen": comfy-kitchen's CUDA kernel), on its
# tables (one a batch row, from rotation matrices) and on random bit patterns; the live comparison with
# comfy-kitchen itself is test/integrations/comfyui/test_patch_gpu.py's.


def _comfy_tables(batch: int, tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    angles = (
        torch.rand(batch, tokens, HEAD_DIM // 2, generator=gen, device="cuda", dtype=torch.float64) * 4000
    )
    cos, sin = angles.cos().float(), angles.sin().float()
    pe = torch.stack([cos, -sin, sin, cos], dim=-1).unflatten(-1, (2, 2))[:, None]
    return reference.comfy_tables(pe)


@pytest.mark.parametrize("rotation", ["addcmul", "kitchen"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize(("txt", "img"), [(1, 7), (77, 513), (512, 4096)])
def test_comfyui_rotations_bit_exact(txt, img, batch, dtype, rotation, gen):
    q, k, v = _double_block((txt, img), 3, batch, dtype, gen)
    cos, sin = _comfy_tables(batch, txt + img, gen)
    assert decline_reason(q, k, cos, sin, v, rotation=rotation) is None
    expected = reference.prologue(q, k, cos, sin, 1e-6, v, rotation=rotation)
    _assert_equal(qk_norm_rope(q, k, cos, sin, v=v, rotation=rotation), expected)
    single_q, single_k = (
        Segment(_heads(batch, txt + img, 3, dtype, gen, width=5), _weight(dtype, gen)) for _ in "qk"
    )
    expected = reference.prologue([single_q], [single_k], cos[:1], sin[:1], 1e-6, rotation=rotation)
    _assert_equal(qk_norm_rope([single_q], [single_k], cos[:1], sin[:1], rotation=rotation), expected)


@pytest.mark.parametrize("rotation", ["addcmul", "kitchen"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_comfyui_rotations_on_random_bit_patterns(dtype, rotation, gen):
    """Any rows, weights (subnormal norm outputs, which comfy-kitchen flushes) and tables (subnormal
    entries included): the kernel is the rotation's arithmetic."""
    q, k, v = (random_bits((2, 37, 3, HEAD_DIM), dtype, gen) for _ in range(3))
    wq, wk = (random_bits((HEAD_DIM,), dtype, gen) for _ in range(2))
    finite = torch.rand(2, 37, HEAD_DIM, generator=gen, device="cuda") * 2 - 1
    table = torch.ldexp(finite, torch.randint(-150, 60, finite.shape, generator=gen, device="cuda").float())
    rows = ([Segment(q, wq)], [Segment(k, wk)], table, table.flip(1), 1e-6, [v])
    got = qk_norm_rope(*rows[:4], v=[v], rotation=rotation)
    _assert_equal(got, reference.prologue(*rows, rotation=rotation))


def test_kitchen_flushes_subnormal_norm_outputs_addcmul_keeps_them(gen):
    """A weight of 2^-130 makes the norm's outputs bf16 subnormals: comfy-kitchen's rotation reads them
    as zero, torch's keeps them."""
    x = (1 + torch.rand(1, 5, 2, HEAD_DIM, generator=gen, device="cuda")).to(torch.bfloat16)  # r * x near 1
    weight = torch.full((HEAD_DIM,), 2.0**-130, device="cuda").to(torch.bfloat16)
    cos, sin = torch.ones(5, HEAD_DIM, device="cuda"), torch.zeros(5, HEAD_DIM, device="cuda")
    rows = ([Segment(x, weight)], [Segment(x, weight)], cos, sin)
    kept, flushed = (qk_norm_rope(*rows, rotation=rotation)[0] for rotation in ("addcmul", "kitchen"))
    assert (kept != 0).all() and kept.abs().max() < torch.finfo(torch.float32).tiny
    assert (flushed == 0).all()


@pytest.mark.parametrize("rotation", ["addcmul", "kitchen"])
def test_comfyui_rotation_self_checks(rotation, gen):
    """Each rotation has its own self-check verdict, and apply() launches it."""
    q, k, v = _double_block((7, 29), 3, 2, torch.bfloat16, gen)
    cos, sin = _comfy_tables(2, 36, gen)
    assert guards.segment_guard(False, rotation)(q[0].x, q[0].weight, cos, sin)
    records = {key[:3]: record for key, record in self_check_records().items()}
    assert records[("qk_norm_rope", "cuda:0", f"head_dim=128 bfloat16 {rotation}")].passed
    assert fused(q, k, cos, sin, 1e-6, v, rotation=rotation) is not None


# Qwen-Image's and Z-Image's prologue: diffusers' `RMSNorm` module ("mean") with the complex rotation,
# on complex frequencies laid out as tables by `reference.complex_tables`.
QWEN = {"rotation": "complex", "norm": "mean"}


def _complex_tables(*shape: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit frequencies of random angles [..., S, 64] (as `torch.polar` builds them) as tables."""
    angles = torch.rand(*shape, HEAD_DIM // 2, generator=gen, device="cuda", dtype=torch.float64) * 4000
    return reference.complex_tables(torch.polar(torch.ones_like(angles), angles).to(torch.complex64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("heads", [3, 24])
@pytest.mark.parametrize(("txt", "img"), [(6, 7), (77, 513), (512, 4096)])
def test_qwen_double_block_bit_exact(txt, img, heads, batch, dtype, gen):
    """Qwen-Image's double block: text and image segments of q, k, v (at least 16 head rows each,
    where aten's mean keeps a row in one warp), one table for the joint rows."""
    q, k, v = _double_block((txt, img), heads, batch, dtype, gen)
    cos, sin = _complex_tables(txt + img, gen=gen)
    assert decline_reason(q, k, cos, sin, v, **QWEN) is None
    _assert_equal(
        qk_norm_rope(q, k, cos, sin, v=v, **QWEN), reference.prologue(q, k, cos, sin, 1e-6, v, **QWEN)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 33, 4096 + 7])
def test_z_image_single_stream_bit_exact(tokens, dtype, gen):
    """Z-Image's single stream: one segment of q and k, a table a batch row, no v."""
    q, k = ([Segment(_heads(2, tokens, 30, dtype, gen, width=3), _weight(dtype, gen))] for _ in "qk")
    cos, sin = _complex_tables(2, tokens, gen=gen)
    _assert_equal(
        qk_norm_rope(q, k, cos, sin, 1e-5, **QWEN), reference.prologue(q, k, cos, sin, 1e-5, **QWEN)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qwen_random_bit_patterns(dtype, gen):
    """Any rows and weights, finite tables of any exponent (subnormal entries included), each
    frequency repeated for its pair: the kernel is diffusers' pow/mean norm and the complex product."""
    for _ in range(4):
        q, k, v = ([random_bits((2, n, 5, HEAD_DIM), dtype, gen) for n in (31, 70)] for _ in range(3))
        q = [Segment(x, random_bits((HEAD_DIM,), dtype, gen)) for x in q]
        k = [Segment(x, random_bits((HEAD_DIM,), dtype, gen)) for x in k]
        finite = torch.rand(101, HEAD_DIM // 2, generator=gen, device="cuda") * 2 - 1
        exponents = torch.randint(-150, 60, finite.shape, generator=gen, device="cuda").float()
        cos = torch.ldexp(finite, exponents).repeat_interleave(2, dim=1)
        sin = torch.ldexp(finite.flip(0), exponents).repeat_interleave(2, dim=1)
        _assert_equal(
            qk_norm_rope(q, k, cos, sin, v=v, **QWEN), reference.prologue(q, k, cos, sin, 1e-6, v, **QWEN)
        )


def test_mean_norm_subnormal_squares_and_rounding(gen):
    """Heads of ~1e-21 have subnormal squares, where RN(x^2) summed and fma(x, x, s) differ; the mean
    norm must follow diffusers' module, and differ from aten's fused norm somewhere on ordinary rows
    (its product with r is rounded to bf16 before the weight)."""
    tiny = (torch.randn(1, 64, 4, HEAD_DIM, generator=gen, device="cuda") * 1e-21).to(torch.bfloat16)
    rows = (
        [Segment(tiny, _weight(torch.bfloat16, gen))],
        [Segment(tiny.flip(1), _weight(torch.bfloat16, gen))],
    )
    cos, sin = _complex_tables(64, gen=gen)
    _assert_equal(
        qk_norm_rope(*rows, cos, sin, 1e-45, **QWEN), reference.prologue(*rows, cos, sin, 1e-45, **QWEN)
    )
    q, k, _ = _double_block((64, 300), 4, 1, torch.bfloat16, gen)
    cos, sin = _complex_tables(364, gen=gen)
    mean = qk_norm_rope(q, k, cos, sin, **QWEN)[0]
    assert bits_equal(mean, reference.prologue(q, k, cos, sin, 1e-6, **QWEN)[0])
    aten = reference.rope(
        torch.cat([reference.rms_norm(s.x, s.weight, 1e-6) for s in q], dim=1), cos, sin, "complex"
    )
    assert not bits_equal(mean, aten)


def test_qwen_equals_diffusers_attention_processor(monkeypatch, gen):
    """diffusers' own Qwen-Image attention on the GPU: the joint q, k and v its processor hands to
    attention are the kernel's, bit for bit."""
    qwen = pytest.importorskip("diffusers.models.transformers.transformer_qwenimage")
    heads, txt, img = 24, 512, 4096
    block = qwen.QwenImageTransformerBlock(
        dim=heads * HEAD_DIM, num_attention_heads=heads, attention_head_dim=HEAD_DIM
    )
    attn = block.attn.to("cuda", torch.bfloat16)
    with torch.no_grad():
        for norm in (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k):
            norm.weight.copy_(_weight(torch.bfloat16, gen))
    seen = {}

    def attention(query, key, value, **_):
        seen.update(query=query, key=key, value=value)
        return torch.zeros_like(value)

    monkeypatch.setattr(qwen, "dispatch_attention_fn", attention)
    embed = qwen.QwenEmbedRope(theta=10000, axes_dim=[16, 56, 56], scale_rope=True)
    img_freqs, txt_freqs = embed([(1, 64, 64)], max_txt_seq_len=txt, device=torch.device("cuda"))
    x = torch.randn(1, img, heads * HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    c = torch.randn(1, txt, heads * HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        attn(hidden_states=x, encoder_hidden_states=c, image_rotary_emb=(img_freqs, txt_freqs))
        parts = [
            (proj(rows).unflatten(-1, (heads, -1)), norm)
            for rows, proj, norm in (
                (c, attn.add_q_proj, attn.norm_added_q),
                (x, attn.to_q, attn.norm_q),
                (c, attn.add_k_proj, attn.norm_added_k),
                (x, attn.to_k, attn.norm_k),
            )
        ]
        v = [attn.add_v_proj(c).unflatten(-1, (heads, -1)), attn.to_v(x).unflatten(-1, (heads, -1))]
        q, k = ([Segment(rows, norm.weight) for rows, norm in parts[i : i + 2]] for i in (0, 2))
        cos, sin = reference.complex_tables(torch.cat([txt_freqs, img_freqs]))
        got = qk_norm_rope(q, k, cos, sin, attn.norm_q.eps, v, **QWEN)
    for name, a in zip(("query", "key", "value"), got, strict=True):
        assert torch.equal(a, seen[name]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qwen_self_check_verdict_and_fallback(dtype, gen):
    """The mode has its own verdict per dtype (then `fused` launches); a table that is not a contiguous
    float32 [S, 128] declines and `apply` runs the eager chain."""
    q, k, v = _double_block((7, 29), 3, 2, dtype, gen)
    cos, sin = _complex_tables(36, gen=gen)
    assert guards.segment_guard(False, "complex", "mean")(q[0].x, q[0].weight, cos, sin)
    name = str(dtype).removeprefix("torch.")
    records = {key[:3]: record for key, record in self_check_records().items()}
    assert records[("qk_norm_rope", "cuda:0", f"head_dim=128 {name} complex mean norm")].passed
    assert fused(q, k, cos, sin, 1e-6, v, **QWEN) is not None
    passed, detail = OP.self_check(torch.device("cuda"), Config(dtype, **QWEN))
    assert passed, detail
    assert fused(q, k, cos.half(), sin, 1e-6, v, **QWEN) is None
    strided = torch.empty(36, 2 * HEAD_DIM, device="cuda")[:, ::2]
    strided.copy_(cos)
    assert fused(q, k, strided, sin, 1e-6, v, **QWEN) is None
    expected = reference.prologue(q, k, cos, sin, 1e-6, v, **QWEN)
    _assert_equal(apply(q, k, strided, sin, 1e-6, v, **QWEN), expected)


def test_a_segment_of_few_head_rows_runs_the_eager_chain(gen):
    """Fewer than 16 head rows in a segment (one text token of three heads): aten's mean sums a row
    over more threads there, so the launch declines and `apply` gives the eager chain's bits."""
    q, k, v = _double_block((1, 40), 3, 1, torch.float16, gen)
    cos, sin = _complex_tables(41, gen=gen)
    assert decline_reason(q, k, cos, sin, v, **QWEN) is not None
    _assert_equal(apply(q, k, cos, sin, 1e-6, v, **QWEN), reference.prologue(q, k, cos, sin, 1e-6, v, **QWEN))
