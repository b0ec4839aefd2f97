"""GPU tests: the fused kernel equals eager bit for bit (run with `pytest -m gpu` on a CUDA machine)."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.ops import bits_equal, random_bits, self_check_records
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
