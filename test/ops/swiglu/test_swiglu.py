"""CPU tests of the swiglu op: the reference is diffusers' Flux2SwiGLU, every decline reason with its
message, the validated op's errors, garbage never raises, the fallback on the CPU, the operator."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from flux2_fused.ops import swiglu
from flux2_fused.ops.swiglu import decline_reason, guards, library, reference
from flux2_fused.ops.verdicts import TypeReason

from ..conftest import as_cuda, misaligned, reason_templates, untested

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
    "x not a tensor": ((1.0,), "x is not a tensor"),
    "x 1-D": ((as_cuda(torch.zeros(16, dtype=BF16)),), "x must be [B, S, C] or [S, C], got (16,)"),
    "x inner stride": (
        (as_cuda(torch.zeros(B, S, 4 * H, dtype=BF16))[..., ::2],),
        "x has inner stride 2 (needs 1)",
    ),
    "x row stride": (
        (as_cuda(torch.zeros(B, S, 2 * H + 2, dtype=BF16))[..., 2:],),
        "x row stride 18 is not a multiple of 4 elements",
    ),
    "x batch stride": (
        (
            as_cuda(
                torch.zeros(B * S * 2 * H + 2, dtype=BF16).as_strided(
                    (B, S, 2 * H), (S * 2 * H + 2, 2 * H, 1)
                )
            ),
        ),
        f"x batch stride {S * 2 * H + 2} is not a multiple of 4 elements",
    ),
    "channels": (
        (as_cuda(torch.zeros(B, S, 12, dtype=BF16)),),
        "x has 12 channels, the kernel needs 2H with H a positive multiple of 4",
    ),
    "cpu": ((torch.zeros(B, S, 2 * H, dtype=BF16),), "x is on cpu, the fused kernel needs CUDA"),
    "float32": ((_x(dtype=torch.float32),), "dtype torch.float32 is not supported (bfloat16, float16)"),
    "grad": (
        (as_cuda(torch.zeros(B, S, 2 * H, dtype=BF16).requires_grad_()),),
        "x requires grad and the fused kernel has no backward",
    ),
    "misaligned": ((as_cuda(misaligned(B, S, 2 * H)),), "x data pointer is not 8-byte aligned"),
    "out not a tensor": ((_x(), 3), "out is not a tensor"),
    "out dtype": (
        (_x(), _out(dtype=torch.float16)),
        "out is torch.float16 on cuda:0, x is torch.bfloat16 on cuda:0",
    ),
    "out shape": (
        (_x(), as_cuda(torch.zeros(B, S, 2 * H, dtype=BF16))),
        "out shape (2, 5, 16) is not x's rows at half width",
    ),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.usefixtures("accept_runtime")
def test_decline_reason(name: str) -> None:
    args, expected = CASES[name]
    reason = decline_reason(*args)
    assert reason == expected
    assert swiglu.fused(*args) is None
    error = TypeError if isinstance(reason, TypeReason) else ValueError
    with pytest.raises(error, match=f"^{re.escape('flux2-fused: ' + reason)}$"):
        swiglu.swiglu(*args)


@pytest.mark.usefixtures("accept_runtime")
def test_out_sharing_x_storage_declines() -> None:
    x = torch.zeros(B, S, 3 * H, dtype=BF16)
    args = (as_cuda(x[..., : 2 * H]), as_cuda(x[..., 2 * H :]))
    assert decline_reason(*args) == "out shares storage with x"
    assert swiglu.fused(*args) is None
    with pytest.raises(ValueError, match="out shares storage with x"):
        swiglu.swiglu(*args)


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
    """In x's place or out's: declined with a reason, never an exception."""
    for args in ((garbage,), (_x(), garbage), (garbage, _out())):
        assert swiglu.fused(*args) is None
        assert decline_reason(*args) is not None


def test_apply_on_the_cpu_is_the_eager_chain() -> None:
    x = torch.randn(B, S, 2 * H)
    assert swiglu.fused(x) is None
    assert torch.equal(swiglu.apply(x), reference.swiglu(x))
    buffer = torch.zeros(B, S, 2 * H)
    assert torch.equal(swiglu.apply(x, out=buffer[..., H:]), reference.swiglu(x))
    assert torch.equal(buffer[..., H:], reference.swiglu(x)) and not buffer[..., :H].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_operator_opcheck_and_gradients_cpu(dtype: torch.dtype) -> None:
    x = torch.randn(B, S, 2 * H).to(dtype)
    torch.library.opcheck(library.swiglu, (x,))
    assert torch.equal(library.swiglu(x), reference.swiglu(x))
    leaf = x.float().requires_grad_()
    library.swiglu(leaf).sum().backward()
    twin = x.float().requires_grad_()
    reference.swiglu(twin).sum().backward()
    assert torch.equal(leaf.grad, twin.grad)


def test_every_decline_reason_has_a_case() -> None:
    produced = [reason for _, reason in CASES.values()] + ["out shares storage with x"]
    templates = reason_templates(guards)
    assert len(templates) >= 10
    missing = untested(templates, produced)
    assert not missing, f"decline reasons without a test case: {missing}"
