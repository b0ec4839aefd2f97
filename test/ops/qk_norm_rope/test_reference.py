"""The eager reference is diffusers' FLUX.2 prologue, op for op: RMSNorm modules, text-first concat,
diffusers' own apply_rotary_emb, v's concat. Checked bit for bit on the CPU for the two layouts."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.ops.qk_norm_rope import Segment, reference

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
