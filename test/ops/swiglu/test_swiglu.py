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
}


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


def test_apply_on_the_cpu_is_the_eager_chain() -> None:
    x = torch.randn(B, S, 2 * H)
    assert swiglu.fused(x) is None
    assert torch.equal(swiglu.apply(x), reference.swiglu(x))
    buffer = torch.zeros(B, S, 2 * H)
    assert torch.equal(swiglu.apply(x, out=buffer[..., H:]), reference.swiglu(x))
    assert torch.equal(buffer[..., H:], reference.swiglu(x)) and not buffer[..., :H].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_operator_opcheck_and_gradients_cpu(dtype: torch.dtype) -> None:
    conftest.assert_operator_is_the_reference(
        library.swiglu, reference.swiglu, torch.randn(B, S, 2 * H).to(dtype)
    )


def test_every_decline_reason_has_a_case() -> None:
    conftest.assert_every_reason_has_a_case([reason for _, reason in CASES.values()], guards, rowwise)
