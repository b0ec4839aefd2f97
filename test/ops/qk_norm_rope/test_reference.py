"""The eager reference is diffusers' FLUX.2 prologue, op for op: RMSNorm modules, text-first concat,
diffusers' own apply_rotary_emb, v's concat. Checked bit for bit on the CPU for the two layouts."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.ops.qk_norm_rope import HEAD_DIM, Segment, reference

embeddings = pytest.importorskip("diffusers.models.embeddings")


def _tables(tokens: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(tokens, dim // 2, dtype=torch.float64) * 100
    return angles.cos().repeat_interleave(2, 1).float(), angles.sin().repeat_interleave(2, 1).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_double_block_layout_is_diffusers_chain(dtype: torch.dtype) -> None:
    heads, dim, txt, img = 3, 16, 5, 9
    norm_txt, norm_img = torch.nn.RMSNorm(dim, eps=1e-6), torch.nn.RMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        norm_txt.weight.normal_()
        norm_img.weight.normal_()
    norm_txt, norm_img = norm_txt.to(dtype), norm_img.to(dtype)
    q_txt = torch.randn(2, txt, heads * dim).to(dtype).unflatten(-1, (-1, dim))
    q_img = torch.randn(2, img, heads * dim).to(dtype).unflatten(-1, (-1, dim))
    cos, sin = _tables(txt + img, dim)
    expected = embeddings.apply_rotary_emb(
        torch.cat([norm_txt(q_txt), norm_img(q_img)], dim=1), (cos, sin), sequence_dim=1
    )
    rows = [Segment(q_txt, norm_txt.weight), Segment(q_img, norm_img.weight)]
    assert torch.equal(reference.qk_norm_rope(rows, cos, sin, 1e-6), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_block_layout_is_diffusers_chain(dtype: torch.dtype) -> None:
    heads, dim, tokens = 2, 16, 7
    norm = torch.nn.RMSNorm(dim, eps=1e-6).to(dtype)
    wide = torch.randn(1, tokens, 5 * heads * dim).to(dtype)
    query = wide[..., heads * dim : 2 * heads * dim].unflatten(-1, (-1, dim))  # a strided chunk view
    cos, sin = _tables(tokens, dim)
    expected = embeddings.apply_rotary_emb(norm(query), (cos, sin), sequence_dim=1)
    assert torch.equal(reference.qk_norm_rope([Segment(query, norm.weight)], cos, sin, 1e-6), expected)


def test_prologue_is_q_k_and_the_concat_of_v() -> None:
    """`prologue` = the chain for q, the chain for k, and diffusers' `cat` of v (None without v)."""
    dim, txt, img = 16, 3, 4
    segments = [[Segment(torch.randn(2, n, 2, dim), torch.randn(dim)) for n in (txt, img)] for _ in range(2)]
    v = [torch.randn(2, n, 2, dim) for n in (txt, img)]
    cos, sin = _tables(txt + img, dim)
    q, k, value = reference.prologue(*segments, cos, sin, 1e-6, v)
    assert torch.equal(q, reference.qk_norm_rope(segments[0], cos, sin, 1e-6))
    assert torch.equal(k, reference.qk_norm_rope(segments[1], cos, sin, 1e-6))
    assert torch.equal(value, torch.cat(v, dim=1))
    assert reference.prologue(*segments, cos, sin, 1e-6)[2] is None


# FLUX.3 (`upcast=True`): diffusers 0.42's `Flux3AttnProcessor` on q and k [B, S, H, 128] of a 16-bit
# model whose q/k norms are kept in float32 (`_keep_in_fp32_modules`).


def _flux3_chain(query, key, value, norm_q, norm_k, rotary):
    """The processor's prologue, transcribed: norm on the upcast rows, fp32 RoPE, one cast."""
    query = norm_q(query.float())
    key = norm_k(key.float())
    query = embeddings.apply_rotary_emb(query, rotary, sequence_dim=1)
    key = embeddings.apply_rotary_emb(key, rotary, sequence_dim=1)
    return query.to(value.dtype), key.to(value.dtype)


def _fp32_norm() -> torch.nn.RMSNorm:
    norm = torch.nn.RMSNorm(128, eps=1e-6)  # float32, as from_pretrained keeps it
    with torch.no_grad():
        norm.weight.normal_()  # full-precision float32 weights: the norm's products are not rounded
    return norm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunked", [False, True])
def test_upcast_is_flux3_processor_chain(dtype: torch.dtype, chunked: bool) -> None:
    """q and k as views of separate projections or as chunks of a fused qkv projection."""
    heads, tokens = 3, 11
    if chunked:
        qkv = torch.randn(2, tokens, 3 * heads * 128).to(dtype)
        query, key, value = (t.unflatten(-1, (heads, -1)) for t in qkv.chunk(3, dim=-1))
    else:
        query, key, value = (
            torch.randn(2, tokens, heads * 128).to(dtype).unflatten(-1, (heads, -1)) for _ in "qkv"
        )
    query[0, 0, 0] = 0.0  # a zero head: rsqrt(eps)
    key[1, 2, 1] = 3.0  # a constant head
    norm_q, norm_k = _fp32_norm(), _fp32_norm()
    cos, sin = _tables(tokens, 128)
    expected = _flux3_chain(query, key, value, norm_q, norm_k, (cos, sin))
    q, k, v = reference.prologue(
        [Segment(query, norm_q.weight)], [Segment(key, norm_k.weight)], cos, sin, 1e-6, upcast=True
    )
    assert v is None
    assert q.dtype == k.dtype == dtype
    assert torch.equal(q, expected[0]) and torch.equal(k, expected[1])
    # FLUX.2's chain (norm on the 16-bit rows, output rounded) is another function: the mode matters
    rounded = reference.prologue(
        [Segment(query, norm_q.weight.to(dtype))], [Segment(key, norm_k.weight.to(dtype))], cos, sin, 1e-6
    )
    assert not torch.equal(rounded[0], q)


def test_upcast_is_diffusers_flux3_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """diffusers' own module and processor: the q and k it hands to attention are the reference's."""
    flux3 = pytest.importorskip("diffusers.models.transformers.transformer_flux3")
    heads, tokens, dim = 2, 9, 48
    attn = flux3.Flux3Attention(query_dim=dim, heads=heads, dim_head=128).to(torch.bfloat16)
    attn.norm_q.float()
    attn.norm_k.float()
    with torch.no_grad():
        attn.norm_q.weight.normal_()
        attn.norm_k.weight.normal_()
    seen = {}

    def attention(query, key, value, **_):
        seen.update(query=query, key=key)
        return torch.zeros_like(value)

    monkeypatch.setattr(flux3, "dispatch_attention_fn", attention)
    ids = torch.randint(0, 64, (tokens, 4))
    cos, sin = flux3.Flux3PosEmbed(theta=10000, axes_dim=[32, 32, 32, 32])(ids)
    h = torch.randn(2, tokens, dim).to(torch.bfloat16)
    with torch.no_grad():
        attn(h, image_rotary_emb=(cos, sin))
        query, key = (proj(h).unflatten(-1, (heads, -1)) for proj in (attn.to_q, attn.to_k))
        q, k, _ = reference.prologue(
            [Segment(query, attn.norm_q.weight)],
            [Segment(key, attn.norm_k.weight)],
            cos,
            sin,
            1e-6,
            upcast=True,
        )
    assert torch.equal(q, seen["query"]) and torch.equal(k, seen["key"])


def test_upcast_two_segments_are_normed_then_joined() -> None:
    """Two segments (the layout one launch also takes): each normalized in fp32 with its weight, joined
    in fp32, rotated, rounded once; v is concatenated as in FLUX.2's mode."""
    dim, txt, img = 16, 3, 4
    x = [torch.randn(2, n, 2, dim).to(torch.bfloat16) for n in (txt, img)]
    w = [torch.randn(dim) for _ in range(2)]
    v = [torch.randn(2, n, 2, dim).to(torch.bfloat16) for n in (txt, img)]
    cos, sin = _tables(txt + img, dim)
    rows = [Segment(a, b) for a, b in zip(x, w, strict=True)]
    normed = torch.cat(
        [torch.nn.functional.rms_norm(a.float(), (dim,), b, 1e-6) for a, b in zip(x, w, strict=True)], 1
    )
    expected = embeddings.apply_rotary_emb(normed, (cos, sin), sequence_dim=1).to(torch.bfloat16)
    q, k, value = reference.prologue(rows, rows, cos, sin, 1e-6, v, upcast=True)
    assert torch.equal(q, expected) and torch.equal(k, expected)
    assert torch.equal(value, torch.cat(v, dim=1))


def _comfy_pe(batch: int, tokens: int) -> torch.Tensor:
    """Rotation matrices [B, 1, S, 64, 2, 2] as ComfyUI's FLUX `rope` builds them: (cos, -sin; sin, cos)."""
    angles = torch.rand(batch, tokens, HEAD_DIM // 2, dtype=torch.float64) * 4000
    cos, sin = angles.cos().float(), angles.sin().float()
    return torch.stack([cos, -sin, sin, cos], dim=-1).unflatten(-1, (2, 2))[:, None]


def _matrix_rope(x: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
    """ComfyUI's own rotation of x [B, S, H, hd] (its `_apply_rope1` on the [B, H, S, hd] view): the
    first column's product, then `addcmul_` with the second."""
    x_ = x.transpose(1, 2).float().reshape(*x.transpose(1, 2).shape[:-1], -1, 1, 2)
    out = pe[..., 0] * x_[..., 0]
    out.addcmul_(pe[..., 1], x_[..., 1])
    return out.reshape(*x.transpose(1, 2).shape).type_as(x).transpose(1, 2)


def test_comfy_tables_carry_the_matrix_entries() -> None:
    pe = _comfy_pe(2, 9)
    pe[0, 0, 3, 5, 0, 1] = float("nan")
    cos, sin = reference.comfy_tables(pe)
    assert cos.shape == sin.shape == (2, 9, HEAD_DIM) and cos.is_contiguous()
    m = pe[:, 0]
    for got, entry in ((cos[..., 0::2], m[..., 0, 0]), (-sin[..., 0::2], m[..., 0, 1])):
        assert torch.equal(got.view(torch.int32), entry.view(torch.int32))
    for got, entry in ((sin[..., 1::2], m[..., 1, 0]), (cos[..., 1::2], m[..., 1, 1])):
        assert torch.equal(got.view(torch.int32), entry.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_addcmul_rotation_is_comfyuis_own(dtype: torch.dtype) -> None:
    """The "addcmul" rotation on ComfyUI's tables is ComfyUI's torch rotation on its matrices."""
    pe = _comfy_pe(2, 11)
    x = torch.randn(2, 11, 3, HEAD_DIM).to(dtype)
    assert torch.equal(reference.rope(x, *reference.comfy_tables(pe), "addcmul"), _matrix_rope(x, pe))


def test_kitchen_rotation_flushes_subnormals() -> None:
    """comfy-kitchen's fast-math kernel reads a subnormal input as zero and writes a subnormal result
    as zero: a pair (tiny, 0) rotates to (0, 0) where torch keeps it."""
    tiny = torch.finfo(torch.float32).tiny / 4  # a float32 subnormal, a bf16 one too
    x = torch.zeros(1, 1, 1, HEAD_DIM, dtype=torch.bfloat16)
    x[..., 0] = tiny
    cos, sin = torch.ones(1, HEAD_DIM), torch.zeros(1, HEAD_DIM)
    assert reference.rope(x, cos, sin, "addcmul")[..., 0].item() == x[..., 0].item() != 0
    assert reference.rope(x, cos, sin, "kitchen")[..., 0].item() == 0
    with pytest.raises(ValueError, match="rotation 'rope' is not one of"):
        reference.rope(x, cos, sin, "rope")


def _complex_freqs(*shape: int) -> torch.Tensor:
    """Unit complex frequencies as Qwen-Image's and Z-Image's embedders build them (`torch.polar`)."""
    angles = torch.rand(*shape, dtype=torch.float64) * 1000
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mean_norm_is_diffusers_rmsnorm(dtype: torch.dtype) -> None:
    """The "mean" norm is diffusers' own `RMSNorm` module (pow/mean, rounded to the weight's dtype,
    then the weight), bit for bit; it differs from aten's fused `rms_norm` on some rows."""
    normalization = pytest.importorskip("diffusers.models.normalization")
    norm = normalization.RMSNorm(HEAD_DIM, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(3, 17, 4, HEAD_DIM) * torch.logspace(-3, 3, 17)[None, :, None, None]).to(dtype)
    with torch.no_grad():
        assert torch.equal(reference.rms_norm(x, norm.weight, 1e-6, "mean"), norm(x))
        if dtype != torch.float32:
            assert not torch.equal(reference.rms_norm(x, norm.weight, 1e-6), norm(x))
    with pytest.raises(ValueError, match="norm 'layer' is not one of"):
        reference.rms_norm(x, norm.weight, 1e-6, "layer")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen_prologue_is_diffusers_chain(dtype: torch.dtype) -> None:
    """Qwen-Image's double block: each stream's q through its diffusers `RMSNorm`, rotated by its own
    complex frequencies with `apply_rotary_emb_qwen`, joined text first: the "mean" norm with the
    "complex" rotation over the joint tables `complex_tables` builds, bit for bit."""
    qwen = pytest.importorskip("diffusers.models.transformers.transformer_qwenimage")
    normalization = pytest.importorskip("diffusers.models.normalization")
    heads, txt, img = 3, 5, 9
    norms = [normalization.RMSNorm(HEAD_DIM, eps=1e-6).to(dtype) for _ in range(2)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.normal_()
    q_txt, q_img = (torch.randn(2, n, heads, HEAD_DIM).to(dtype) for n in (txt, img))
    txt_freqs, img_freqs = _complex_freqs(txt, HEAD_DIM // 2), _complex_freqs(img, HEAD_DIM // 2)
    with torch.no_grad():
        expected = torch.cat(
            [
                qwen.apply_rotary_emb_qwen(norms[0](q_txt), txt_freqs, use_real=False),
                qwen.apply_rotary_emb_qwen(norms[1](q_img), img_freqs, use_real=False),
            ],
            dim=1,
        )
        cos, sin = reference.complex_tables(torch.cat([txt_freqs, img_freqs]))
        rows = [Segment(q_txt, norms[0].weight), Segment(q_img, norms[1].weight)]
        got = reference.qk_norm_rope(rows, cos, sin, 1e-6, rotation="complex", norm="mean")
    assert cos.shape == (txt + img, HEAD_DIM) and cos.is_contiguous() and sin.is_contiguous()
    assert torch.equal(got, expected)


def test_complex_rotation_takes_a_table_a_batch_row() -> None:
    """Z-Image's frequencies come one a batch row ([B, S, hd/2]): its `view_as_complex` product with
    them, op for op."""
    x = torch.randn(2, 7, 3, HEAD_DIM).to(torch.bfloat16)
    freqs = _complex_freqs(2, 7, HEAD_DIM // 2)
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    expected = torch.view_as_real(pairs * freqs.unsqueeze(2)).flatten(3).type_as(x)
    assert torch.equal(reference.rope(x, *reference.complex_tables(freqs), "complex"), expected)
