"""GPU tests: the fused kernel equals eager bit for bit (run with `pytest -m gpu` on a CUDA machine).

FLUX.1/FLUX.2 layouts (per-batch and broadcast modulation rows, one update, one or two segments with
one modulation) first; then FLUX.3's: per-token modulation rows (chunks of [B, T, 3D], [T, D],
[1, T, D]), the two-term update, and the single block's two segments with their own modulation.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from flux2_fused.ops import bits_equal, random_bits, self_check_records
from flux2_fused.ops import gated_resnorm as op
from flux2_fused.ops.gated_resnorm import (
    Segment,
    gated_resnorm,
    gated_resnorm_decline_reason,
    gated_resnorm_reference,
    guards,
    modnorm,
    modnorm_reference,
)
from flux2_fused.ops.gated_resnorm.launch import launch

from ...conftest import fused_launches

pytestmark = pytest.mark.gpu

TOKENS = [1, 7, 64, 512, 4096, 4608, 16896]
DIMS = [3072, 4096, 6144, 8192, 5000]  # 5000: D % 512 != 0, threads end with different counts


def _rows(batch: int, tokens: int, dim: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """randn rows, with rows scaled x1e3 and x1e-3, constant rows and NaN / Inf rows mixed in."""
    x = torch.randn(batch, tokens, dim, generator=gen, device="cuda", dtype=torch.float32)
    x[:, 1::5] *= 1e3
    x[:, 2::5] *= 1e-3
    x[:, 3::11] = x[:, 3::11, :1]  # constant rows: variance 0
    if tokens > 4:
        x[0, 4, dim // 3] = float("nan")
        x[-1, tokens - 1, 1] = float("inf")
    return x.to(dtype)


def _modulation(batch: int, dim: int, dtype: torch.dtype, layout: str, gen: torch.Generator):
    mod = torch.randn(batch, 1, 6 * dim, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    shift, scale, gate = mod.chunk(6, dim=-1)[3:]  # strided [B, 1, D] views, as FLUX.2 chunks them
    if layout == "broadcast":
        return gate[0, 0], scale[:1, 0], shift[:1]  # [D], [1, D], [1, 1, D]
    return gate, scale, shift


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["strided", "broadcast"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_gated_resnorm_bit_exact(tokens, dim, batch, layout, dtype, gen):
    residual = _rows(batch, tokens, dim, dtype, gen)
    update = _rows(batch, tokens, dim, dtype, gen)
    gate, scale, shift = _modulation(batch, dim, dtype, layout, gen)
    before = residual.clone(), update.clone()
    out, residual_out = gated_resnorm(residual, update, gate, scale, shift)
    ref_out, ref_residual = gated_resnorm_reference(residual, update, gate, scale, shift)
    assert bits_equal(residual_out, ref_residual)
    assert bits_equal(out, ref_out)
    assert torch.equal(before[0].view(torch.int16), residual.view(torch.int16))  # inputs untouched
    assert torch.equal(before[1].view(torch.int16), update.view(torch.int16))
    x = _rows(batch, tokens, dim, dtype, gen)
    assert bits_equal(modnorm(x, scale, shift), modnorm_reference(x, scale, shift))


def _edge_value_cases(dim: int, dtype: torch.dtype, gen: torch.Generator):
    """Inputs aimed at the packed T-pair arithmetic (see Vec4 in gated_resnorm.cuh): products below
    fp32's normal range, (1 + scale) near 0, overflow, non-finite modulation, random bit patterns."""
    tiny, huge = (1e-20, 3e38) if dtype == torch.bfloat16 else (1e-4, 6e4)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

    steps = torch.randint(-3, 4, (1, 1, dim), generator=gen, device="cuda")
    near_minus_one = (-1 + steps * 2.0**-8).to(dtype)
    yield (
        "subnormal products",
        (
            randn(2, 33, dim, scale=tiny * tiny),
            randn(2, 33, dim, scale=tiny),
            randn(1, 1, dim, scale=tiny),
            near_minus_one,
            randn(1, 1, dim, scale=tiny * tiny),
        ),
    )
    gate, scale, shift = randn(1, 1, dim), randn(1, 1, dim), randn(1, 1, dim)
    gate[..., 5], scale[..., 7], shift[..., 9] = float("nan"), float("inf"), -float("inf")
    gate[..., 13], scale[..., 11], scale[..., 15] = huge, float("nan"), -1.0
    streams = randn(2, 33, dim, scale=huge), randn(2, 33, dim, scale=1e3)
    yield "overflow, non-finite modulation", (*streams, gate, scale, shift)
    shapes = [(2, 33, dim)] * 2 + [(2, 1, dim)] * 3
    yield "random bit patterns", tuple(random_bits(shape, dtype, gen) for shape in shapes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("dim", [3072, 6144, 5000])
def test_edge_values_bit_exact(dim, dtype, gen):
    for name, (residual, update, gate, scale, shift) in _edge_value_cases(dim, dtype, gen):
        out, residual_out = gated_resnorm(residual, update, gate, scale, shift)
        ref_out, ref_residual = gated_resnorm_reference(residual, update, gate, scale, shift)
        assert bits_equal(residual_out, ref_residual), name
        assert bits_equal(out, ref_out), name
        x = residual_out
        assert bits_equal(modnorm(x, scale, shift), modnorm_reference(x, scale, shift)), name


def _comfyui_modulation(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """ComfyUI's modulated norm as its blocks write it: `apply_mod(norm(x), 1 + scale, shift)`."""
    return torch.addcmul(shift, F.layer_norm(x, (x.shape[-1],), eps=1e-6), 1 + scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["strided", "broadcast"])
@pytest.mark.parametrize("dim", [3072, 6144, 5000])
@pytest.mark.parametrize("tokens", [1, 7, 4608])
def test_addcmul_modulation_bit_exact(tokens, dim, layout, dtype, gen):
    """`addcmul=True` (ComfyUI's rounding: one for the product and the sum) on random and edge rows,
    gated and plain, against ComfyUI's chain written out."""
    residual, update = _rows(2, tokens, dim, dtype, gen), _rows(2, tokens, dim, dtype, gen)
    gate, scale, shift = _modulation(2, dim, dtype, layout, gen)
    cases = [("random rows", (residual, update, gate, scale, shift))]
    cases += list(_edge_value_cases(dim, dtype, gen))
    for name, (r, u, g, sc, sh) in cases:
        out, residual_out = gated_resnorm(r, u, g, sc, sh, addcmul=True)
        expected_stream = r + g * u
        assert bits_equal(residual_out, expected_stream), name
        assert bits_equal(out, _comfyui_modulation(expected_stream, sc, sh)), name
        assert bits_equal(modnorm(r, sc, sh, addcmul=True), _comfyui_modulation(r, sc, sh)), name


@pytest.mark.parametrize("dim", [4, 64, 260, 512, 1028, 2052, 16384])
def test_small_and_large_hidden_sizes(dim, gen):
    residual, update = _rows(2, 33, dim, torch.bfloat16, gen), _rows(2, 33, dim, torch.bfloat16, gen)
    gate, scale, shift = _modulation(2, dim, torch.bfloat16, "strided", gen)
    out, residual_out = gated_resnorm(residual, update, gate, scale, shift)
    ref_out, ref_residual = gated_resnorm_reference(residual, update, gate, scale, shift)
    assert bits_equal(residual_out, ref_residual) and bits_equal(out, ref_out)


def test_two_dimensional_stream(gen):
    residual, update = (
        _rows(1, 300, 3072, torch.bfloat16, gen)[0],
        _rows(1, 300, 3072, torch.bfloat16, gen)[0],
    )
    gate, scale, shift = _modulation(1, 3072, torch.bfloat16, "broadcast", gen)
    out, residual_out = gated_resnorm(residual, update, gate, scale, shift)
    ref_out, ref_residual = gated_resnorm_reference(residual, update, gate, scale, shift)
    assert out.shape == ref_out.shape and residual_out.shape == ref_residual.shape  # eager broadcasting
    assert bits_equal(residual_out, ref_residual) and bits_equal(out, ref_out)


def test_two_segments_write_the_concat(gen):
    """Text rows then image rows, each with its own gate, into one [B, T_txt + T_img, D] buffer."""
    dim, dtype = 3072, torch.bfloat16
    txt = [_rows(2, 77, dim, dtype, gen) for _ in range(2)]
    img = [_rows(2, 1000, dim, dtype, gen) for _ in range(2)]
    g_txt, _, _ = _modulation(2, dim, dtype, "strided", gen)
    g_img, scale, shift = _modulation(2, dim, dtype, "strided", gen)
    out, residual_out = launch(
        [Segment(txt[0], txt[1], g_txt), Segment(img[0], img[1], g_img)],
        scale,
        shift,
        1e-6,
        write_residual=True,
    )
    ref_residual = torch.cat([txt[0] + g_txt * txt[1], img[0] + g_img * img[1]], dim=1)
    assert bits_equal(residual_out, ref_residual)
    assert bits_equal(out, modnorm_reference(ref_residual, scale, shift))


def test_strided_rows_without_residual_out(gen):
    """The output-norm site: image rows sliced out of the joint stream, the residual never written."""
    dim, dtype = 4096, torch.bfloat16
    joint = [_rows(2, 512 + 999, dim, dtype, gen) for _ in range(2)]
    gate, scale, shift = _modulation(2, dim, dtype, "strided", gen)
    img = [t[:, 512:] for t in joint]
    out, residual_out = launch([Segment(img[0], img[1], gate)], scale, shift, 1e-6, write_residual=False)
    assert residual_out is None
    ref_out, _ = gated_resnorm_reference(img[0], img[1], gate, scale, shift)
    assert bits_equal(out, ref_out)


def test_offsets_past_int32(gen):
    """More than 2**31 elements: row offsets must be 64-bit."""
    tokens, dim = 2**31 // 8192 + 3, 8192
    residual = torch.randn(1, tokens, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    update = torch.randn(1, tokens, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    gate, scale, shift = _modulation(1, dim, torch.bfloat16, "strided", gen)
    out, residual_out = gated_resnorm(residual, update, gate, scale, shift)
    tail = slice(tokens - 64, tokens)
    ref_out, ref_residual = gated_resnorm_reference(residual[:, tail], update[:, tail], gate, scale, shift)
    assert bits_equal(residual_out[:, tail], ref_residual) and bits_equal(out[:, tail], ref_out)


def test_follows_current_stream_and_graph_capture(gen):
    dim, dtype = 6144, torch.bfloat16
    residual, update = _rows(1, 512, dim, dtype, gen), _rows(1, 512, dim, dtype, gen)
    gate, scale, shift = _modulation(1, dim, dtype, "strided", gen)
    assert guards.gated(residual, update, gate, scale, shift)  # self-check runs here
    ref_out, ref_residual = gated_resnorm_reference(residual, update, gate, scale, shift)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out, residual_out = gated_resnorm(residual, update, gate, scale, shift)
    torch.cuda.current_stream().wait_stream(side)
    assert bits_equal(out, ref_out) and bits_equal(residual_out, ref_residual)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert guards.gated(residual, update, gate, scale, shift)
        g_out, g_residual = gated_resnorm(residual, update, gate, scale, shift)
    g_out.fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    assert bits_equal(g_out, ref_out) and bits_equal(g_residual, ref_residual)


def test_unchecked_configuration_declines_during_capture(gen):
    dim = 1540  # a size nothing else in the session has self-checked
    residual, update = _rows(1, 8, dim, torch.bfloat16, gen), _rows(1, 8, dim, torch.bfloat16, gen)
    gate, scale, shift = _modulation(1, dim, torch.bfloat16, "strided", gen)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        reason = gated_resnorm_decline_reason(residual, update, gate, scale, shift)
    assert reason is not None and "capture" in reason
    assert guards.gated(residual, update, gate, scale, shift)  # checked outside capture


def test_gpu_guard_rejections(gen):
    dim = 3072
    residual, update = _rows(1, 16, dim, torch.bfloat16, gen), _rows(1, 16, dim, torch.bfloat16, gen)
    gate, scale, shift = _modulation(1, dim, torch.bfloat16, "strided", gen)
    cases = {
        "not contiguous": (residual[:, ::2], update[:, ::2], gate, scale, shift),
        "aligned": (residual.flatten()[1 : -(dim - 1)].view(1, 15, dim), update[:, 1:], gate, scale, shift),
        "differs from residual": (residual, update[:, 1:], gate, scale, shift),
        "float32": (residual, update, gate.float(), scale, shift),
        "requires grad": (residual, update.clone().requires_grad_(), gate, scale, shift),
    }
    for expected, args in cases.items():
        reason = gated_resnorm_decline_reason(*args)
        assert reason is not None and expected in reason, (expected, reason)
        assert not guards.gated(*args)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tensors_on_a_device_other_than_the_current_one():
    """The entry sets the tensors' device around the launch (and uses that device's current stream):
    with cuda:0 current, a site on cuda:1 self-checks, launches there and equals eager there; the
    current device is unchanged afterwards."""
    other = torch.device("cuda", 1)
    with torch.cuda.device(0):
        gen1 = torch.Generator(device=other).manual_seed(7)
        dim, dtype = 3072, torch.bfloat16
        residual = torch.randn(2, 77, dim, generator=gen1, device=other).to(dtype)
        update = torch.randn(2, 77, dim, generator=gen1, device=other).to(dtype)
        shift, scale, gate = (
            torch.randn(2, 1, 6 * dim, generator=gen1, device=other).to(dtype).chunk(6, -1)[:3]
        )
        assert guards.gated(residual, update, gate, scale, shift)  # self-check for cuda:1 runs here
        records = {key[:3]: record for key, record in self_check_records().items()}
        assert records[("gated_resnorm", "cuda:1", f"D={dim} bfloat16")].passed
        side = torch.cuda.Stream(device=other)
        side.wait_stream(torch.cuda.current_stream(other))
        with torch.cuda.stream(side):
            out, residual_out = gated_resnorm(residual, update, gate, scale, shift)
            plain = modnorm(residual, scale, shift)
        torch.cuda.current_stream(other).wait_stream(side)
        assert torch.cuda.current_device() == 0
        assert out.device == other and residual_out.device == other
        ref_out, ref_residual = gated_resnorm_reference(residual, update, gate, scale, shift)
        assert bits_equal(out, ref_out) and bits_equal(residual_out, ref_residual)
        assert bits_equal(plain, modnorm_reference(residual, scale, shift))


# --- FLUX.3: per-token modulation, the two-term update, per-segment modulation ---

FLUX3_TOKENS = [1, 7, 37, 4097]  # odd counts; 37: a small image, 4097: past a power of two
FLUX3_DIMS = [3072, 5000]  # 3072: FLUX.3 (24 heads x 128); 5000: threads end with different counts


def _per_token_modulation(batch: int, tokens: int, dim: int, dtype: torch.dtype, layout: str, gen):
    """(gate, scale, shift) per token: `torch.chunk(temb_mod, 3, dim=-1)` of a [B, T, 3D] tensor
    (FLUX.3's blocks), of a [T, 3D] one ([T, D] rows shared by the batch), [1, T, D] rows, or a
    per-token gate with FLUX.2's per-batch scale and shift. Edge rows as in `_rows`."""
    if layout == "[B, T, 3D] chunks":
        shift, scale, gate = _rows(batch, tokens, 3 * dim, dtype, gen).chunk(3, dim=-1)
    elif layout == "[T, D] chunks":
        shift, scale, gate = _rows(1, tokens, 3 * dim, dtype, gen)[0].chunk(3, dim=-1)
    elif layout == "[1, T, D]":
        shift, scale, gate = (_rows(1, tokens, dim, dtype, gen) for _ in range(3))
    else:  # per-token gate, per-batch scale and shift
        gate = _rows(batch, tokens, 3 * dim, dtype, gen)[..., dim : 2 * dim]
        _, scale, shift = _modulation(batch, dim, dtype, "strided", gen)
    return gate, scale, shift


PER_TOKEN_LAYOUTS = ["[B, T, 3D] chunks", "[T, D] chunks", "[1, T, D]", "per-token gate only"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("terms", [1, 2], ids=["update", "update+update2"])
@pytest.mark.parametrize("layout", PER_TOKEN_LAYOUTS)
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dim", FLUX3_DIMS)
@pytest.mark.parametrize("tokens", FLUX3_TOKENS)
def test_per_token_modulation_bit_exact(tokens, dim, batch, layout, terms, dtype, gen):
    """FLUX.3's mode-block site: `residual + gate * (update + update2)` (or one update) into the next
    norm, modulation rows per token; and the plain variant with the same rows."""
    residual, update, update2 = (_rows(batch, tokens, dim, dtype, gen) for _ in range(3))
    update2 = update2 if terms == 2 else None
    gate, scale, shift = _per_token_modulation(batch, tokens, dim, dtype, layout, gen)
    before = [t.clone() for t in (residual, update, gate, scale, shift)]
    out, residual_out = gated_resnorm(residual, update, gate, scale, shift, update2=update2)
    ref_out, ref_residual = gated_resnorm_reference(residual, update, gate, scale, shift, update2=update2)
    assert out.shape == ref_out.shape and residual_out.shape == ref_residual.shape
    assert bits_equal(residual_out, ref_residual)
    assert bits_equal(out, ref_out)
    for t, b in zip((residual, update, gate, scale, shift), before, strict=True):  # inputs untouched
        assert torch.equal(t.view(torch.int16), b.view(torch.int16))
    x = _rows(batch, tokens, dim, dtype, gen)
    assert bits_equal(modnorm(x, scale, shift), modnorm_reference(x, scale, shift))


def test_per_token_rows_of_a_2d_stream(gen):
    """A [T, D] stream with [T, D] rows stays [T, D]; with [1, T, D] rows it becomes [1, T, D]."""
    dim, dtype = 3072, torch.bfloat16
    residual, update, update2 = (_rows(1, 301, dim, dtype, gen)[0] for _ in range(3))
    shift, scale, gate = _rows(1, 301, 3 * dim, dtype, gen).chunk(3, dim=-1)
    for rows in ((gate[0], scale[0], shift[0]), (gate, scale, shift)):
        out, residual_out = gated_resnorm(residual, update, *rows, update2=update2)
        ref_out, ref_residual = gated_resnorm_reference(residual, update, *rows, update2=update2)
        assert out.shape == ref_out.shape and residual_out.shape == ref_residual.shape
        assert bits_equal(residual_out, ref_residual) and bits_equal(out, ref_out)


def _two_term_edge_cases(dim: int, dtype: torch.dtype, gen: torch.Generator):
    """`_edge_value_cases` for the two-term update and per-token rows: subnormal products and sums of
    the updates, (1 + scale) near 0, updates whose sum overflows or cancels, non-finite modulation,
    random bit patterns in all six inputs."""
    tiny, huge = (1e-20, 3e38) if dtype == torch.bfloat16 else (1e-4, 6e4)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

    steps = torch.randint(-3, 4, (2, 33, dim), generator=gen, device="cuda")
    near_minus_one = (-1 + steps * 2.0**-8).to(dtype)
    yield (
        "subnormal products",
        (
            randn(2, 33, dim, scale=tiny * tiny),
            randn(2, 33, dim, scale=tiny),
            randn(2, 33, dim, scale=tiny),
            randn(2, 33, dim, scale=tiny),
            near_minus_one,
            randn(2, 33, dim, scale=tiny * tiny),
        ),
    )
    update = randn(2, 33, dim, scale=huge)
    cancel = -update  # update + update2 == +0 exactly: the gate then multiplies a signed zero
    cancel[:, 1::2] = randn(2, 16, dim, scale=huge)  # odd rows: sums that overflow
    gate, scale, shift = randn(2, 33, dim), randn(2, 33, dim), randn(2, 33, dim)
    gate[..., 5], scale[..., 7], shift[..., 9] = float("nan"), float("inf"), -float("inf")
    gate[..., 13], scale[..., 11], scale[..., 15] = huge, float("nan"), -1.0
    yield (
        "cancelling and overflowing updates",
        (randn(2, 33, dim, scale=1e3), update, cancel, gate, scale, shift),
    )
    yield "random bit patterns", tuple(random_bits((2, 33, dim), dtype, gen) for _ in range(6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("dim", [3072, 6144, 5000])
def test_two_term_edge_values_bit_exact(dim, dtype, gen):
    for name, (residual, update, update2, gate, scale, shift) in _two_term_edge_cases(dim, dtype, gen):
        out, residual_out = gated_resnorm(residual, update, gate, scale, shift, update2=update2)
        ref_out, ref_residual = gated_resnorm_reference(residual, update, gate, scale, shift, update2=update2)
        assert bits_equal(residual_out, ref_residual), name
        assert bits_equal(out, ref_out), name
        assert bits_equal(
            modnorm(residual_out, scale, shift), modnorm_reference(residual_out, scale, shift)
        ), name


def _flux3_single_block_inputs(batch: int, text: int, image: int, dim: int, dtype: torch.dtype, gen):
    """Text and image streams with FLUX.3's pending two-term updates, and each mode's [B, T, 3D]
    modulation split as its single block splits it: (rows, (c_scale, scale), (c_shift, shift))."""
    txt = [_rows(batch, text, dim, dtype, gen) for _ in range(3)]
    img = [_rows(batch, image, dim, dtype, gen) for _ in range(3)]
    c_shift, c_scale, c_gate = _rows(batch, text, 3 * dim, dtype, gen).chunk(3, dim=-1)
    shift, scale, gate = _rows(batch, image, 3 * dim, dtype, gen).chunk(3, dim=-1)
    rows = [Segment(txt[0], txt[1], c_gate, update2=txt[2]), Segment(img[0], img[1], gate, update2=img[2])]
    return rows, (c_scale, scale), (c_shift, shift)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize(("text", "image"), [(7, 37), (1, 4096 + 7), (77, 1)])
def test_single_block_per_segment_modulation(text, image, batch, dtype, gen):
    """FLUX.3's single block input in one launch: text rows normalized with the text modulation,
    image rows with the image modulation, both written into one joint buffer (text first), and the
    concat of the two streams: equal to diffusers' chain, and run by the kernel (`fused` accepts)."""
    dim = 3072
    rows, scales, shifts = _flux3_single_block_inputs(batch, text, image, dim, dtype, gen)
    result = op.fused(rows, scales, shifts, 1e-6, write_residual=True)
    assert result is not None, op.decline_reason(rows, scales, shifts)
    out, stream = result
    enc, hs = (segment.materialize() for segment in rows)
    norm_enc = (1 + scales[0]) * F.layer_norm(enc, (dim,), eps=1e-6) + shifts[0]
    norm_hs = (1 + scales[1]) * F.layer_norm(hs, (dim,), eps=1e-6) + shifts[1]
    assert bits_equal(stream, torch.cat([enc, hs], dim=1))
    assert bits_equal(out, torch.cat([norm_enc, norm_hs], dim=1))
    ref_out, ref_stream = op.reference.segments(rows, scales, shifts)
    assert bits_equal(out, ref_out) and bits_equal(stream, ref_stream)
    out_only, none = op.fused(rows, scales, shifts, 1e-6, write_residual=False)
    assert none is None and bits_equal(out_only, ref_out)
    one_term = [Segment(s.residual, s.update, s.gate) for s in rows]
    out, stream = op.fused(one_term, scales, shifts, 1e-6, write_residual=True)
    ref_out, ref_stream = op.reference.segments(one_term, scales, shifts)
    assert bits_equal(out, ref_out) and bits_equal(stream, ref_stream)
    plain = [Segment(enc), Segment(hs)]
    out, _ = op.fused(plain, scales, shifts, 1e-6, write_residual=False)
    assert bits_equal(out, op.reference.segments(plain, scales, shifts)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_shared_modulation_given_per_segment_is_the_concat_norm(dtype, gen):
    """One modulation for both segments (FLUX.2's single block norms the concat) and the same rows
    given per segment (FLUX.3's form) give the same bits: LayerNorm and the modulation are per row
    (docs/numerics.md 3.6), here on the GPU against eager's norm of the concat."""
    dim = 3072
    txt = [_rows(2, 7, dim, dtype, gen) for _ in range(2)]
    img = [_rows(2, 37, dim, dtype, gen) for _ in range(2)]
    g_txt, _, _ = _modulation(2, dim, dtype, "strided", gen)
    g_img, scale, shift = _modulation(2, dim, dtype, "strided", gen)
    rows = [Segment(txt[0], txt[1], g_txt), Segment(img[0], img[1], g_img)]
    shared = op.fused(rows, scale, shift, 1e-6, write_residual=True)
    per_segment = op.fused(rows, (scale, scale), (shift, shift), 1e-6, write_residual=True)
    assert shared is not None and per_segment is not None
    ref_out, ref_stream = op.reference.segments(rows, scale, shift)  # eager: norm of the concat
    for out, stream in (shared, per_segment):
        assert bits_equal(out, ref_out) and bits_equal(stream, ref_stream)
    eager_per_segment = op.reference.segments(rows, (scale, scale), (shift, shift))
    assert bits_equal(eager_per_segment[0], ref_out)


def test_two_segments_with_one_per_token_modulation_launch(gen):
    """The launcher's shared modulation over two segments is the concat's: per-token rows of the
    joint stream, the second segment's rows `split` rows in. (The entry point declines this form and
    asks for one per segment; the launcher takes it, so the kernel's addressing is pinned here.)"""
    dim, dtype = 3072, torch.bfloat16
    txt = [_rows(2, 7, dim, dtype, gen) for _ in range(3)]
    img = [_rows(2, 37, dim, dtype, gen) for _ in range(3)]
    shift, scale, gate = _rows(2, 44, 3 * dim, dtype, gen).chunk(3, dim=-1)
    rows = [
        Segment(txt[0], txt[1], gate[:, :7], update2=txt[2]),
        Segment(img[0], img[1], gate[:, 7:], update2=img[2]),
    ]
    out, stream = launch(rows, scale, shift, 1e-6, write_residual=True)
    ref_out, ref_stream = op.reference.segments(rows, scale, shift)
    assert bits_equal(stream, ref_stream) and bits_equal(out, ref_out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flux3_blocks_through_defer_and_apply(dtype, gen):
    """Three FLUX.3 mode blocks' ends, a single block's start and the output norm through the entry
    points, each update left pending into the next norm: every site runs the kernel (one launch
    each) and every output equals diffusers' chain."""
    batch, tokens, text, dim = 2, 37, 7, 3072
    hidden = _rows(batch, tokens, dim, dtype, gen)
    eager_hidden = hidden
    launches: list[int] = []
    for _ in range(3):
        attn, ff = _rows(batch, tokens, dim, dtype, gen), _rows(batch, tokens, dim, dtype, gen)
        temb_mod, next_mod = (_rows(batch, tokens, 3 * dim, dtype, gen) for _ in range(2))
        gate = temb_mod.chunk(3, dim=-1)[2]
        shift, scale, _ = next_mod.chunk(3, dim=-1)

        def site(hidden=hidden, attn=attn, ff=ff, gate=gate, scale=scale, shift=shift):
            pending = op.defer(hidden, attn, gate, update2=ff)
            assert isinstance(pending, Segment) and pending.deferred == "kernel"
            return op.apply([pending], scale, shift, 1e-6, write_residual=True)

        launches.append(fused_launches(site))
        out, hidden = site()
        eager_hidden = eager_hidden + gate * (attn + ff)
        assert bits_equal(hidden, eager_hidden)
        assert bits_equal(out, (1 + scale) * F.layer_norm(eager_hidden, (dim,), eps=1e-6) + shift)
    assert launches == [1, 1, 1]
    # The single block: text and image rows with their own modulation, one launch.
    txt_rows, txt_update, txt_update2 = (_rows(batch, text, dim, dtype, gen) for _ in range(3))
    c_shift, c_scale, c_gate = _rows(batch, text, 3 * dim, dtype, gen).chunk(3, dim=-1)
    attn, ff = _rows(batch, tokens, dim, dtype, gen), _rows(batch, tokens, dim, dtype, gen)
    shift, scale, gate = _rows(batch, tokens, 3 * dim, dtype, gen).chunk(3, dim=-1)
    rows = [
        op.defer(txt_rows, txt_update, c_gate, update2=txt_update2),
        op.defer(hidden, attn, gate, update2=ff),
    ]
    assert (
        fused_launches(lambda: op.apply(rows, (c_scale, scale), (c_shift, shift), 1e-6, write_residual=True))
        == 1
    )
    joint_out, joint = op.apply(rows, (c_scale, scale), (c_shift, shift), 1e-6, write_residual=True)
    enc, hs = txt_rows + c_gate * (txt_update + txt_update2), eager_hidden + gate * (attn + ff)
    assert bits_equal(joint, torch.cat([enc, hs], dim=1))
    norm_enc = (1 + c_scale) * F.layer_norm(enc, (dim,), eps=1e-6) + c_shift
    norm_hs = (1 + scale) * F.layer_norm(hs, (dim,), eps=1e-6) + shift
    assert bits_equal(joint_out, torch.cat([norm_enc, norm_hs], dim=1))
    # The output norm (Flux3AdaLayerNorm: `norm(x) * (1 + scale) + shift`) on the image rows of the
    # joint stream, a view with the joint batch stride, per-token scale and shift from chunk(2).
    emb = _rows(batch, tokens, 2 * dim, dtype, gen)
    scale, shift = emb.chunk(2, dim=-1)
    image_rows = joint[:, text:]

    def output_norm():
        return op.apply([Segment(image_rows)], scale, shift, 1e-6, write_residual=False)[0]

    assert fused_launches(output_norm) == 1
    expected = F.layer_norm(image_rows, (dim,), eps=1e-6) * (1 + scale) + shift
    assert bits_equal(output_norm(), expected)


def test_flux2_layouts_still_take_the_flux2_kernels(gen):
    """FLUX.2's sites after the growth: same guards' answers, same outputs (the tests above this
    section), and the kernel instantiation without per-row modulation (its registers and code are
    FLUX.2's): a per-token row anywhere switches the launch to the streamed, per-row addressing."""
    dim, dtype = 6144, torch.bfloat16
    residual, update = _rows(2, 512, dim, dtype, gen), _rows(2, 512, dim, dtype, gen)
    gate, scale, shift = _modulation(2, dim, dtype, "strided", gen)
    names = []

    def kernels(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if "gated_resnorm_kernel" in e.name]

    # <T, kVecs = 12, kTerms = 1, kRowMod, kFull = true, kAddcmul = false>
    names = kernels(lambda: gated_resnorm(residual, update, gate, scale, shift))
    assert len(names) == 1 and "12, 1, false, true, false>" in names[0], names
    per_token_gate = _rows(2, 512, dim, dtype, gen)
    names = kernels(lambda: gated_resnorm(residual, update, per_token_gate, scale, shift))
    assert len(names) == 1 and "12, 1, true, true, false>" in names[0], names


# The quantizing form: out as torchao's per-row float8, for FLUX.1's, FLUX.2's and FLUX.3's sites.

QUANTIZED_TOKENS = [1, 7, 512, 4096, 4608]


def _float8_of(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's per-row quantization of eager's out (float8_quant's reference, eager's kernels)."""
    from flux2_fused.ops.float8_quant import reference as float8_reference

    return float8_reference.quantize(out, "row")


def _same_float8(got: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor]) -> bool:
    from flux2_fused.ops.float8_quant.selfcheck import same

    return same(got, expected)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs sm_89"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["strided", "broadcast"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dim", [3072, 4096, 6144])
@pytest.mark.parametrize("tokens", QUANTIZED_TOKENS)
def test_quantized_form_is_torchaos_float8_of_eagers_out(tokens, dim, batch, layout, dtype, gen):
    """Gated and plain rows, edge rows included (NaN and Inf rows, constant rows, x1e3 and x1e-3):
    the bytes and scales are torchao's quantization of eager's out, the stream is eager's, in one
    launch of the quantizing kernel and none of the plain one."""
    residual = _rows(batch, tokens, dim, dtype, gen)
    update = _rows(batch, tokens, dim, dtype, gen)
    gate, scale, shift = _modulation(batch, dim, dtype, layout, gen)
    ref_out, ref_stream = gated_resnorm_reference(residual, update, gate, scale, shift)
    rows = [Segment(residual, update, gate)]
    got = op.quantized(rows, scale, shift, 1e-6, write_residual=True)  # the first call self-checks
    assert got is not None, op.quantized_reason(rows, scale, shift)
    q, q_scale, stream = got
    assert fused_launches(lambda: op.quantized(rows, scale, shift, 1e-6, write_residual=True)) == 1
    assert bits_equal(stream, ref_stream)
    assert _same_float8((q, q_scale), _float8_of(ref_out))
    plain = op.quantized([Segment(residual)], scale, shift, 1e-6, write_residual=True)
    assert plain is not None and plain[2] is residual
    assert _same_float8(plain[:2], _float8_of(modnorm_reference(residual, scale, shift)))


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs sm_89"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("dim", [3072, 6144])
def test_quantized_form_edge_values(dim, dtype, gen):
    """Subnormal products, overflow, non-finite modulation and random bit patterns (NaN and zero
    scales, rows at the float8 maximum): torchao's bits of eager's out, two segments too."""
    for name, (residual, update, gate, scale, shift) in _edge_value_cases(dim, dtype, gen):
        got = op.quantized([Segment(residual, update, gate)], scale, shift, 1e-6, write_residual=True)
        assert got is not None, name
        ref_out, ref_stream = gated_resnorm_reference(residual, update, gate, scale, shift)
        assert bits_equal(got[2], ref_stream), name
        assert _same_float8(got[:2], _float8_of(ref_out)), name
    txt = [_rows(2, 77, dim, dtype, gen) for _ in range(2)]
    img = [_rows(2, 1001, dim, dtype, gen) for _ in range(2)]
    g_txt, _, _ = _modulation(2, dim, dtype, "strided", gen)
    g_img, scale, shift = _modulation(2, dim, dtype, "strided", gen)
    rows = [Segment(txt[0], txt[1], g_txt), Segment(img[0], img[1], g_img)]
    q, q_scale, stream = op.quantized(rows, scale, shift, 1e-6, write_residual=True)
    ref_stream = torch.cat([txt[0] + g_txt * txt[1], img[0] + g_img * img[1]], dim=1)
    assert bits_equal(stream, ref_stream)
    assert _same_float8((q, q_scale), _float8_of(modnorm_reference(ref_stream, scale, shift)))


def _flux3_cases(batch: int, tokens: int, dim: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """FLUX.3's norm sites as (rows, scale, shift, write_residual): a mode block's norm of its input
    rows and of a pending two-term update, and a joint block's twin norms of two
    pending two-term updates (text rows, then `tokens` image rows) or of two materialized streams,
    each segment with its own per-token modulation (strided chunks of a [B, T, 3D] tensor, edge rows
    in it)."""

    def modulation(rows: int) -> tuple[torch.Tensor, ...]:
        return _rows(batch, rows, 3 * dim, dtype, gen).chunk(3, dim=-1)

    def segment(rows: int, terms: int) -> tuple[Segment, torch.Tensor, torch.Tensor]:
        shift, scale, gate = modulation(rows)
        residual = _rows(batch, rows, dim, dtype, gen)
        if terms == 0:
            return Segment(residual), scale, shift
        update, update2 = (_rows(batch, rows, dim, dtype, gen) for _ in range(2))
        return Segment(residual, update, gate, update2=update2 if terms == 2 else None), scale, shift

    def twin(terms: int) -> tuple:
        (text, c_scale, c_shift), (image, scale, shift) = segment(77, terms), segment(tokens, terms)
        return [text, image], (c_scale, scale), (c_shift, shift), terms > 0

    cases = {}
    for name, terms in (("input rows", 0), ("two-term update", 2)):
        rows, scale, shift = segment(tokens, terms)
        cases[name] = [rows], scale, shift, True
    cases["twin norms of pending updates"] = twin(2)
    cases["twin norms of streams"] = twin(0)
    return cases


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs sm_89"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dim", [3072, 6144])
@pytest.mark.parametrize("tokens", [7, 512, 4096])
def test_quantized_form_takes_flux3s_per_token_sites(tokens, dim, batch, dtype, gen):
    """Per-token modulation, two-term updates and twin segments (`_flux3_cases`): the bytes and
    scales are torchao's quantization of eager's out and the stream is eager's, in one launch."""
    for name, (rows, scale, shift, write_residual) in _flux3_cases(batch, tokens, dim, dtype, gen).items():
        got = op.quantized(rows, scale, shift, 1e-6, write_residual=write_residual)
        assert got is not None, (name, op.quantized_reason(rows, scale, shift, write_residual=write_residual))
        ref_out, ref_stream = op.reference.segments(rows, scale, shift, 1e-6)
        assert _same_float8(got[:2], _float8_of(ref_out)), name
        if rows[0].gated:
            assert bits_equal(got[2], ref_stream), name
        elif write_residual:
            assert got[2] is rows[0].residual, name
        call = functools.partial(op.quantized, rows, scale, shift, 1e-6, write_residual=write_residual)
        assert fused_launches(call) == 1, name


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs sm_89"
)
def test_quantized_form_self_check_and_declines(gen):
    """Its own verdict per (D, dtype); other widths and update forms no model has decline to the
    caller."""
    from flux2_fused.ops import runtime

    for dim in (3072, 4096, 6144):
        for dtype in (torch.bfloat16, torch.float16):
            passed, detail = op.self_check(torch.device("cuda"), op.Config(dim, dtype, "row"))
            assert passed, detail
            assert "per-token" in detail, detail
    residual = _rows(1, 9, 3072, torch.bfloat16, gen)
    shift, scale, gate = _rows(1, 9, 3 * 3072, torch.bfloat16, gen).chunk(3, dim=-1)
    one_term = [Segment(residual, _rows(1, 9, 3072, torch.bfloat16, gen), gate)]
    assert op.quantized(one_term, scale, shift, 1e-6, write_residual=True) is None  # not a FLUX.3 site
    wide = _rows(1, 9, 8192, torch.bfloat16, gen)
    reason = op.quantized_reason([Segment(wide)], wide[:, :1], wide[:, :1])
    assert reason == "the quantizing form takes D of 3072, 4096, 6144, got 8192"
    assert runtime.runtime_reason(op.OP, residual.device, op.Config(3072, torch.bfloat16, "row")) is None


def test_the_entry_refuses_outputs_it_would_write_out_of_place() -> None:
    """The C++ entry writes out, residual_out and the quantizing form's bytes densely, a row every D
    elements: outputs that are not contiguous, or not of the type written, are refused before
    anything launches (Python's launchers allocate them; this guards direct calls)."""
    from flux2_fused.ops import jit
    from flux2_fused.ops.gated_resnorm.launch import SPEC

    module = jit.module_for(SPEC, torch.device("cuda"))
    dim = 3072
    residual, update = (torch.randn(1, 8, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    shift, scale, gate = torch.randn(1, 1, 3 * dim, device="cuda", dtype=torch.bfloat16).chunk(3, dim=-1)
    words = (None, None, None, None)
    tail = (
        scale,
        shift,
        None,
        None,
        residual,
        update,
        None,
        gate,
        None,
        None,
        None,
        None,
        1e-6,
        False,
        *words,
    )
    good = torch.empty_like(residual)
    strided = torch.empty(1, 8, 2 * dim, device="cuda", dtype=torch.bfloat16)[..., :dim]
    cases = [
        ("contiguous", (strided, None, None)),
        ("contiguous", (good, None, strided)),
        ("dtype", (good, None, torch.empty_like(residual, dtype=torch.float16))),
        (
            "float8_e4m3fn",
            (
                torch.empty(1, 8, dim, device="cuda", dtype=torch.int8),
                torch.empty(1, 8, 1, device="cuda"),
                None,
            ),
        ),
    ]
    for words, outputs in cases:
        with pytest.raises(Exception, match=words):
            module.gated_resnorm(*outputs, *tail)
    module.gated_resnorm(good, None, torch.empty_like(residual), *tail)  # the same call, well formed
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("tokens", [7, 512, 4096])
def test_proven_rows_read_one_row_a_batch(tokens, batch, dtype, gen):
    """FLUX.3's sites with uniform_rows' proofs (its modulation made as the model makes it: one row a
    batch in every token's row): eager's bits, plain and quantizing. Where the word is 0 the kernel
    reads each batch's first row for every token: a word of 0 given for rows that differ shows it
    (the output is then eager's on the first rows)."""
    from flux2_fused.ops import uniform_rows

    dim = 3072

    def modulation(rows: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        mod = _rows(batch, 1, 3 * dim, dtype, gen).expand(batch, rows, 3 * dim).contiguous()
        return mod, mod.chunk(3, dim=-1)

    mod, (shift, scale, gate) = modulation(tokens)
    c_mod, (c_shift, c_scale, c_gate) = modulation(77)
    proof, c_proof = uniform_rows.check(mod), uniform_rows.check(c_mod)
    assert proof is not None and c_proof is not None and proof.differs.tolist() == [0]
    x, u, v = (_rows(batch, tokens, dim, dtype, gen) for _ in range(3))
    c, cu, cv = (_rows(batch, 77, dim, dtype, gen) for _ in range(3))
    pending = Segment(x, u, gate, "kernel", update2=v, gate_rows=proof)
    twin = [Segment(c, cu, c_gate, "kernel", update2=cv, gate_rows=c_proof), pending]
    sites = {
        "mode block": ([pending], scale, shift, proof),
        "input rows": ([Segment(x)], scale, shift, proof),
        "twin norms": (twin, (c_scale, scale), (c_shift, shift), (c_proof, proof)),
    }
    for name, (rows, sc, sh, mod_rows) in sites.items():
        ref_out, ref_stream = op.reference.segments(rows, sc, sh, 1e-6)
        out, stream = op.fused(rows, sc, sh, 1e-6, write_residual=True, mod_rows=mod_rows)
        assert bits_equal(out, ref_out) and bits_equal(stream, ref_stream), name
        if torch.cuda.get_device_capability() >= (8, 9):
            q = op.quantized(rows, sc, sh, 1e-6, write_residual=True, mod_rows=mod_rows)
            assert q is not None and _same_float8(q[:2], _float8_of(ref_out)), name
    # Rows that differ in one bit of one token: the check's word is 1, every token's own row is read.
    changed = mod.clone()
    changed.view(torch.int16)[-1, tokens - 1, 5] ^= 1
    ch_shift, ch_scale, ch_gate = changed.chunk(3, dim=-1)
    differs = uniform_rows.check(changed)
    assert differs is not None and differs.differs.tolist() == [int(tokens > 1)]
    rows = [Segment(x, u, ch_gate, "kernel", update2=v, gate_rows=differs)]
    out, stream = op.fused(rows, ch_scale, ch_shift, 1e-6, write_residual=True, mod_rows=differs)
    ref_out, ref_stream = op.reference.segments(rows, ch_scale, ch_shift, 1e-6)
    assert bits_equal(out, ref_out) and bits_equal(stream, ref_stream)
    # A word of 0 for rows that differ: the kernel reads the first row of each batch.
    per_token = _rows(batch, tokens, 3 * dim, dtype, gen)
    p_shift, p_scale, p_gate = per_token.chunk(3, dim=-1)
    lie = torch.zeros(1, dtype=torch.int32, device="cuda")
    rows = [Segment(x, u, p_gate, update2=v)]
    out, stream = launch(rows, p_scale, p_shift, 1e-6, write_residual=True, words=(lie, lie, None, None))
    firsts = [Segment(x, u, p_gate[:, :1], update2=v)], p_scale[:, :1], p_shift[:, :1]
    ref_out, ref_stream = op.reference.segments(*firsts, 1e-6)
    assert bits_equal(out, ref_out) and bits_equal(stream, ref_stream)


def _uniform(batch: int, tokens: int, width: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """FLUX.3's modulation as the model makes it: one random row a batch, in every token's row."""
    return _rows(batch, 1, width, dtype, gen).expand(batch, tokens, width).contiguous()


def _change(mod: torch.Tensor, batch: int, token: int, *columns: int) -> None:
    """Make one token's row differ from its batch's first, in these columns (x -> 2x + 1)."""
    for column in columns:
        mod[batch, token, column] = mod[batch, token, column] * 2 + 1


def _differ(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return not (bits_equal(a[0], b[0]) and bits_equal(a[1], b[1]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_words_of_one_at_every_site_shared_rows_and_broadcast_batches(dtype, gen):
    """A real word of 1 (one token's shift, scale and gate changed, in a row of the stream with no
    planted NaN or Inf, so eager's output shows it) at every site reads every token's own rows; two
    segments of equal length sharing one per-token modulation (given once a segment) with a word of
    0 or 1; a [1, T, 3D] modulation over a batch-2 stream (batch stride 0), with a word of 0 or 1.
    Each output is eager's on the rows as they are, and differs from eager's on the rows before the
    change (so reading the first row in place of the changed one would fail)."""
    from flux2_fused.ops import uniform_rows

    dim, tokens, text, token = 3072, 259, 77, 6  # token 6: none of _rows' constant, NaN or Inf rows

    def sites(mod: torch.Tensor, c_mod: torch.Tensor, streams):
        (shift, scale, gate), (c_shift, c_scale, c_gate) = mod.chunk(3, dim=-1), c_mod.chunk(3, dim=-1)
        proof, c_proof = uniform_rows.check(mod), uniform_rows.check(c_mod)
        assert proof is not None and c_proof is not None
        x, u, v, c, cu, cv = streams
        pending = Segment(x, u, gate, "kernel", update2=v, gate_rows=proof)
        twin = [Segment(c, cu, c_gate, "kernel", update2=cv, gate_rows=c_proof), pending]
        return (
            proof,
            c_proof,
            {
                "mode block": ([pending], scale, shift, proof),
                "input rows": ([Segment(x)], scale, shift, proof),
                "twin norms": (twin, (c_scale, scale), (c_shift, shift), (c_proof, proof)),
            },
        )

    def check_sites(named) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        expected = {}
        for name, (rows, sc, sh, mod_rows) in named.items():
            expected[name] = op.reference.segments(rows, sc, sh, 1e-6)
            result = op.fused(rows, sc, sh, 1e-6, write_residual=True, mod_rows=mod_rows)
            assert result is not None, name
            assert not _differ(result, expected[name]), name
        return expected

    for batch, mod_batch in ((2, 2), (2, 1), (1, 1)):
        streams = [_rows(batch, n, dim, dtype, gen) for n in (tokens,) * 3 + (text,) * 3]
        mod = _uniform(mod_batch, tokens, 3 * dim, dtype, gen)
        c_mod = _uniform(mod_batch, text, 3 * dim, dtype, gen)
        proof, c_proof, named = sites(mod, c_mod, streams)
        assert proof.differs.tolist() == [0] and c_proof.differs.tolist() == [0]
        before = check_sites(named)
        for changed in (mod, c_mod):  # the last batch's token 6: shift, scale and gate
            _change(changed, -1, token, 7, dim + 7, 2 * dim + 7)
        proof, c_proof, named = sites(mod, c_mod, streams)
        assert proof.differs.tolist() == [1] and c_proof.differs.tolist() == [1]
        after = check_sites(named)
        for name in named:
            assert _differ(before[name], after[name]), f"{name}: the change does not show"

    # Two segments of equal length sharing one per-token modulation, given once a segment.
    batch, half = 2, 131
    mod = _uniform(batch, half, 3 * dim, dtype, gen)
    streams = [_rows(batch, half, dim, dtype, gen) for _ in range(4)]
    outputs = []
    for flip in (False, True):
        if flip:  # a gate of batch 0, a scale of batch 1 (tokens 129 and 5: plain rows)
            _change(mod, 0, half - 2, 2 * dim + 1)
            _change(mod, 1, 5, dim + 3)
        shift, scale, gate = mod.chunk(3, dim=-1)
        proof = uniform_rows.check(mod)
        assert proof is not None and proof.differs.tolist() == [int(flip)]
        rows = [
            Segment(streams[0], streams[1], gate, "kernel", gate_rows=proof),
            Segment(streams[2], streams[3], gate, "kernel", gate_rows=proof),
        ]
        outputs.append(op.reference.segments(rows, (scale, scale), (shift, shift), 1e-6))
        result = op.fused(
            rows, (scale, scale), (shift, shift), 1e-6, write_residual=True, mod_rows=(proof, proof)
        )
        assert result is not None, f"shared rows, flip={flip}"
        assert not _differ(result, outputs[-1]), f"shared rows, flip={flip}"
    assert _differ(*outputs), "shared rows: the change does not show"


def test_a_graph_replayed_after_the_rows_change_reads_them(gen):
    """The check and the kernel captured in one CUDA graph: the word is made at every replay, so
    rows changed in place between replays (one token's scale, then all equal again) give eager's
    output on the rows as they are at that replay, which the change shows in."""
    from flux2_fused.ops import uniform_rows

    batch, tokens, dim, dtype = 2, 512, 3072, torch.bfloat16
    mod = _uniform(batch, tokens, 3 * dim, dtype, gen)
    uniform, changed = mod.clone(), mod.clone()
    _change(changed, 1, 257, dim + 11)  # one scale of token 257: a plain row of the stream
    x, u, v = (_rows(batch, tokens, dim, dtype, gen) for _ in range(3))
    shift, scale, gate = mod.chunk(3, dim=-1)

    def site() -> tuple[torch.Tensor, torch.Tensor]:
        proof = uniform_rows.check(mod)
        assert proof is not None
        rows = [Segment(x, u, gate, "kernel", update2=v, gate_rows=proof)]
        result = op.fused(rows, scale, shift, 1e-6, write_residual=True, mod_rows=proof)
        assert result is not None and result[1] is not None
        return result[0], result[1]

    site()  # builds and self-checks outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        site()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = site()
    seen = []
    for rows_now in (changed, uniform, changed):
        mod.copy_(rows_now)
        graph.replay()
        torch.cuda.synchronize()
        seen.append(op.reference.segments([Segment(x, u, gate, update2=v)], scale, shift, 1e-6))
        assert not _differ((out, res), seen[-1])
    assert _differ(seen[0], seen[1]), "the change does not show in eager's output"
