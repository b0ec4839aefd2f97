"""GPU tests: the sandwich-norm kernel's outputs equal eager bit for bit (`pytest -m gpu`): every
variant Z-Image's blocks call, widths across the kernel's range, odd token counts, batch 1 and 2,
bf16 and fp16, edge rows and random bit patterns; diffusers' own `RMSNorm` modules at Z-Image's width;
the self-check's verdict and the fallback."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.ops import bits_equal, random_bits, sandwich_norm, self_check_records
from flux2_fused.ops.sandwich_norm import Config, reference

pytestmark = pytest.mark.gpu


def _rows(batch: int, tokens: int, hidden: int, dtype: torch.dtype, gen: torch.Generator, std: float = 1.0):
    x = (torch.randn(batch, tokens, hidden, generator=gen, device="cuda") * std).to(dtype)
    x[:, 1::5] *= 1e2 if dtype == torch.float16 else 1e15
    x[:, 2::5] *= 1e-3 if dtype == torch.float16 else 1e-20
    x[:, 3::7] = 0.0
    x[:, 5::13, 3] = float("nan")
    x[:, 6::17, -1] = float("inf")
    return x


def _site(batch, tokens, hidden, dtype, gen):
    x, update = _rows(batch, tokens, hidden, dtype, gen), _rows(batch, tokens, hidden, dtype, gen, 4.0)
    weight, update_weight = (torch.randn(hidden, generator=gen, device="cuda").to(dtype) for _ in range(2))
    gate = torch.randn(batch, 1, hidden, generator=gen, device="cuda").to(dtype).tanh()
    scale = 1.0 + torch.randn(batch, 1, hidden, generator=gen, device="cuda").to(dtype)
    return x, weight, scale, update, update_weight, gate


def _assert_equal(got, expected) -> None:
    for a, b in zip(got, expected, strict=True):
        if b is None:
            assert a is None
        else:
            assert a.shape == b.shape and a.dtype == b.dtype and bits_equal(a, b)


VARIANTS = {
    "first norm with a scale": lambda x, w, s, u, uw, g: (x, w, 1e-5, s),
    "first norm alone": lambda x, w, s, u, uw, g: (x, w, 1e-5),
    "gated update, next norm with a scale": lambda x, w, s, u, uw, g: (x, w, 1e-5, s, u, uw, g),
    "gated update alone": lambda x, w, s, u, uw, g: (x, None, 1e-5, None, u, uw, g),
    "ungated update, next norm": lambda x, w, s, u, uw, g: (x, w, 1e-6, None, u, uw, None),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize(("tokens", "hidden"), [(17, 3840), (4608, 3840), (16, 256), (33, 1024), (19, 3968)])
def test_bit_exact(variant, dtype, batch, tokens, hidden, gen):
    args = VARIANTS[variant](*_site(batch, tokens, hidden, dtype, gen))
    assert sandwich_norm.decline_reason(*args) is None
    _assert_equal(sandwich_norm.sandwich_norm(*args), reference.sandwich(*args))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_random_bit_patterns(dtype, gen):
    """Any rows, weights, gates and scales (subnormals, NaN, Inf): the kernel is the eager chain."""
    for hidden in (3840, 512):
        rows = [random_bits((2, 37, hidden), dtype, gen) for _ in range(2)]
        vectors = [random_bits((hidden,), dtype, gen) for _ in range(2)]
        batch_rows = [random_bits((2, 1, hidden), dtype, gen) for _ in range(2)]
        args = (rows[0], vectors[0], 1e-5, batch_rows[0], rows[1], vectors[1], batch_rows[1])
        _assert_equal(sandwich_norm.sandwich_norm(*args), reference.sandwich(*args))


def test_equals_diffusers_rmsnorm_modules(gen):
    """diffusers' own `RMSNorm` modules at Z-Image's width, as its block calls them."""
    normalization = pytest.importorskip("diffusers.models.normalization")
    norm1, norm2 = (normalization.RMSNorm(3840, eps=1e-5).to("cuda", torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        norm1.weight.copy_(torch.randn(3840, generator=gen, device="cuda"))
        norm2.weight.copy_(torch.randn(3840, generator=gen, device="cuda"))
        x, _, scale, attn_out, _, gate = _site(1, 4608, 3840, torch.bfloat16, gen)
        stream = x + gate * norm2(attn_out)
        out = norm1(stream) * scale
        got_out, got_stream = sandwich_norm.sandwich_norm(
            x, norm1.weight, 1e-5, scale, attn_out, norm2.weight, gate
        )
    assert bits_equal(got_stream, stream) and bits_equal(got_out, out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_self_check_verdict_and_fallback(dtype, gen):
    """The width's verdict is recorded per dtype and `fused` then launches; rows it declines (a
    strided x) run the eager chain in `apply`."""
    args = _site(2, 9, 3840, dtype, gen)
    assert sandwich_norm.fused(*args[:2], 1e-5, *args[2:]) is not None
    name = str(dtype).removeprefix("torch.")
    records = {key[:3]: record for key, record in self_check_records().items()}
    assert records[("sandwich_norm", "cuda:0", f"D=3840 {name}")].passed
    passed, detail = sandwich_norm.OP.self_check(torch.device("cuda"), Config(dtype, 1024))
    assert passed, detail
    strided = torch.empty(2, 9, 2 * 3840, device="cuda", dtype=dtype)[..., :3840]
    strided.copy_(args[0])
    assert sandwich_norm.fused(strided, args[1], 1e-5, *args[2:]) is None
    _assert_equal(
        sandwich_norm.apply(strided, args[1], 1e-5, *args[2:]),
        reference.sandwich(args[0], args[1], 1e-5, *args[2:]),
    )


@pytest.mark.parametrize("tokens", [1, 7, 15])
def test_fewer_than_16_rows_run_the_eager_chain(tokens, gen):
    """Below 16 rows aten's mean spreads a row over more warps and sums it in another order: the
    launch declines and `apply` gives the eager chain's bits."""
    args = _site(1, tokens, 3840, torch.float16, gen)
    assert sandwich_norm.decline_reason(*args[:2], 1e-5, *args[2:]) is not None
    _assert_equal(
        sandwich_norm.apply(*args[:2], 1e-5, *args[2:]), reference.sandwich(*args[:2], 1e-5, *args[2:])
    )


# The quantizing form: out as torchao's per-row float8, for the float8 Linears that read it alone.

needs_sm89 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs sm_89"
)


def _float8_of(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's per-row quantization of eager's out (float8_quant's reference, eager's kernels)."""
    from flux2_fused.ops.float8_quant import reference as float8_reference

    return float8_reference.quantize(out, "row")


def _assert_quantized(args: tuple) -> None:
    """The quantizing form of a site: torchao's bytes and scales of eager's out, eager's stream, in
    one launch of the quantizing kernel."""
    from flux2_fused.ops.float8_quant.selfcheck import same

    from ...conftest import fused_launches

    got = sandwich_norm.quantized(*args)
    assert got is not None, sandwich_norm.quantized_reason(*args)
    out, stream = reference.sandwich(*args)
    assert same(got[:2], _float8_of(out))
    assert got[2] is args[0] if len(args) < 5 else bits_equal(got[2], stream)
    assert fused_launches(lambda: sandwich_norm.quantized(*args), (sandwich_norm.KERNEL,)) == 1


@needs_sm89
@pytest.mark.parametrize("variant", [name for name in VARIANTS if name != "gated update alone"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize(("tokens", "hidden"), [(17, 3840), (4608, 3840), (16, 256), (33, 1024), (19, 3968)])
def test_quantized_form_is_torchaos_float8_of_eagers_out(variant, dtype, batch, tokens, hidden, gen):
    """Every site with a next norm, edge rows included (zero, NaN and Inf rows, huge and tiny)."""
    _assert_quantized(VARIANTS[variant](*_site(batch, tokens, hidden, dtype, gen)))


@needs_sm89
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantized_form_random_bit_patterns_and_self_check(dtype, gen):
    """Any rows, weights, gates and scales (subnormals, NaN, Inf, rows at the float8 maximum), and the
    form's own verdict per (dtype, D); the block's last update (no next norm) declines."""
    for hidden in (3840, 512):
        rows = [random_bits((2, 37, hidden), dtype, gen) for _ in range(2)]
        vectors = [random_bits((hidden,), dtype, gen) for _ in range(2)]
        batch_rows = [random_bits((2, 1, hidden), dtype, gen) for _ in range(2)]
        _assert_quantized((rows[0], vectors[0], 1e-5, batch_rows[0], rows[1], vectors[1], batch_rows[1]))
        passed, detail = sandwich_norm.OP.self_check(torch.device("cuda"), Config(dtype, hidden, "row"))
        assert passed, detail
    x, _, _, update, update_weight, gate = _site(2, 37, 3840, dtype, gen)
    assert sandwich_norm.quantized(x, None, 1e-5, None, update, update_weight, gate) is None
