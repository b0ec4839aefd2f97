"""CPU tests of the swiglu op: the reference is diffusers' Flux2SwiGLU, every decline reason with its
message, the validated op's errors, garbage never raises, the fallback on the CPU, the operator."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flux2_fused.ops import rowwise, swiglu
from flux2_fused.ops.swiglu import decline_reason, guards, library, reference

from .. import conftest
from ..conftest import as_cuda

flux2 = pytest.importorskip("diffusers.models.transformers.transformer_flux2")
B, S, H = 2, 5, 8
BF16 = torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_is_diffusers_swiglu(dtype: torch.dtype) -> None:
    x = (torch.randn(B, S, 2 * H) * 6).to(dtype)
    assert torch.equal(reference.swiglu(x), flux2.Flux2SwiGLU()(x))


def _x(**kw: Any) -> torch.Tensor:
    return as_cuda(torch.zeros(B, S, 2 * H, dtype=kw.get("dtype", BF16)))


def _out(**kw: Any) -> torch.Tensor:
    return as_cuda(torch.zeros(B, S, H, dtype=kw.get("dtype", BF16)))


CASES: dict[str, tuple[tuple[Any, ...], str]] = {
    **conftest.row_cases(2 * H, H),
    "channels": (
        (as_cuda(torch.zeros(B, S, 12, dtype=BF16)),),
        "x has 12 channels, the kernel needs 2H with H a positive multiple of 4",
    ),
    "out shape": ((_x(), _x()), "out shape (2, 5, 16) is not x's rows at half width"),
    "two projections, channels": (
        (as_cuda(torch.zeros(B, S, 8, dtype=BF16)[..., :6]), None, as_cuda(torch.zeros(B, S, 6, dtype=BF16))),
        "x has 6 channels, the kernel needs a positive multiple of 4 beside b",
    ),
    "two projections, b shape": ((_out(), None, _x()), "b shape (2, 5, 16) is not x's shape"),
    "two projections, b dtype": (
        (_out(), None, _out(dtype=torch.float16)),
        "b is torch.float16 on cuda:0, x is torch.bfloat16 on cuda:0",
    ),
    "two projections, b inner stride": ((_out(), None, _x()[..., ::2]), "b has inner stride 2 (needs 1)"),
    "two projections, out shape": ((_out(), _x(), _out()), "out shape (2, 5, 16) is not x's shape"),
}


QUANTIZED_CASES = conftest.quantized_cases(2)


@pytest.mark.parametrize("name", QUANTIZED_CASES)
@pytest.mark.usefixtures("accept_runtime")
def test_quantized_decline_reason(name: str) -> None:
    conftest.assert_quantized_declines(guards.rows, swiglu, *QUANTIZED_CASES[name])


@pytest.mark.usefixtures("accept_runtime")
def test_quantizing_declines_below_sm_89(monkeypatch: pytest.MonkeyPatch) -> None:
    conftest.assert_quantizing_declines_below_sm_89(guards.rows, swiglu, 2, monkeypatch)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.usefixtures("accept_runtime")
def test_decline_reason(name: str) -> None:
    conftest.assert_declines(swiglu, swiglu.swiglu, *CASES[name])


@pytest.mark.usefixtures("accept_runtime")
def test_accepts_flux2_layouts() -> None:
    wide = as_cuda(torch.zeros(B, S, 7 * H, dtype=BF16)[..., 3 * H : 5 * H])  # the single block's MLP part
    buffer = torch.zeros(B, S, 2 * H, dtype=BF16)
    assert decline_reason(_x()) is None and guards.plain(_x())
    assert decline_reason(wide, as_cuda(buffer[..., H:])) is None and guards.into(
        wide, as_cuda(buffer[..., H:])
    )


@pytest.mark.parametrize("garbage", [0, "x", torch.tensor(1.0), [1.0]])
@pytest.mark.usefixtures("accept_runtime")
def test_garbage_never_raises(garbage: Any) -> None:
    conftest.assert_garbage_declines(swiglu, garbage, _x(), _out())


@pytest.mark.usefixtures("accept_runtime")
def test_two_projections_overlap_declines() -> None:
    """out may not share storage with either operand (blocks read and write rows in no fixed order)."""
    a, b = _out(), _out()
    assert decline_reason(a, None, b) is None and guards.pair(a, b)
    assert decline_reason(a, a, b) == "out shares storage with x"
    assert decline_reason(a, b, b) == "out shares storage with b"
    assert swiglu.fused(a, b, b) is None
    with pytest.raises(ValueError, match="out shares storage with b"):
        swiglu.swiglu(a, b, b)


def test_reference_of_two_projections_is_z_image_gating() -> None:
    zimage = pytest.importorskip("diffusers.models.transformers.transformer_z_image")
    a, b = torch.randn(B, S, H).to(BF16) * 6, torch.randn(B, S, H).to(BF16)
    assert torch.equal(reference.swiglu(a, b), zimage.FeedForward(H, H)._forward_silu_gating(a, b))


def test_apply_on_the_cpu_is_the_eager_chain() -> None:
    x = torch.randn(B, S, 2 * H)
    assert swiglu.fused(x) is None
    assert torch.equal(swiglu.apply(x), reference.swiglu(x))
    buffer = torch.zeros(B, S, 2 * H)
    assert torch.equal(swiglu.apply(x, out=buffer[..., H:]), reference.swiglu(x))
    assert torch.equal(buffer[..., H:], reference.swiglu(x)) and not buffer[..., :H].any()
    a, b = x.chunk(2, dim=-1)
    assert swiglu.fused(a, None, b) is None
    assert torch.equal(swiglu.apply(a, b=b), reference.swiglu(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_operator_opcheck_and_gradients_cpu(dtype: torch.dtype) -> None:
    conftest.assert_operator_is_the_reference(
        library.swiglu, reference.swiglu, torch.randn(B, S, 2 * H).to(dtype)
    )
    a, b = torch.randn(B, S, H).to(dtype), torch.randn(B, S, H).to(dtype)
    torch.library.opcheck(library.swiglu, (a, b))
    assert torch.equal(library.swiglu(a, b), reference.swiglu(a, b))


def test_every_decline_reason_has_a_case() -> None:
    produced = [reason for _, reason in (*CASES.values(), *QUANTIZED_CASES.values())] + [conftest.UNBUILT]
    conftest.assert_every_reason_has_a_case(produced, guards, rowwise)
