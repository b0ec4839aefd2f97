"""The sandwich-norm guards: every decline reason has a case (and its exact message), the validated op
raises TypeError or ValueError with it, the entry point runs the eager chain for what it declines,
and the verdicts are per (dtype, D)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from flux2_fused.ops import runtime, sandwich_norm
from flux2_fused.ops.sandwich_norm import Config, guards
from flux2_fused.ops.verdicts import TypeReason

from ..conftest import as_cuda, misaligned, reason_templates, untested

BF16, D = torch.bfloat16, 256


def _rows(d: int = D, dtype: torch.dtype = BF16) -> torch.Tensor:
    return as_cuda(torch.randn(2, 9, d).to(dtype))


def _vec(d: int = D, dtype: torch.dtype = BF16) -> torch.Tensor:
    return as_cuda(torch.randn(d).to(dtype))


def _batch_rows(b: int = 2, dtype: torch.dtype = BF16) -> torch.Tensor:
    return as_cuda(torch.randn(b, 1, D).to(dtype))


def _args(**overrides: Any) -> tuple[Any, ...]:
    """(x, weight, eps, scale, update, update_weight, gate) of a full site, with overrides."""
    args = {
        "x": _rows(),
        "weight": _vec(),
        "eps": 1e-5,
        "scale": _batch_rows(),
        "update": _rows(),
        "update_weight": _vec(),
        "gate": _batch_rows(),
    }
    args.update(overrides)
    return tuple(args.values())


CASES: dict[str, tuple[tuple[Any, ...], str]] = {
    "x not a tensor": (_args(x=[1.0]), "x is not a tensor"),
    "x not 3-D": (_args(x=as_cuda(torch.zeros(10, D, dtype=BF16))), "x must be [B, S, D], got (10, 256)"),
    "x strided": (_args(x=as_cuda(torch.zeros(2, 9, 2 * D, dtype=BF16)[..., :D])), "x is not contiguous"),
    "x on the CPU": (_args(x=torch.zeros(2, 9, D, dtype=BF16)), "x is on cpu, the fused kernel needs CUDA"),
    "x in fp32": (
        _args(x=_rows(dtype=torch.float32)),
        "dtype torch.float32 is not supported (bfloat16, float16)",
    ),
    "D not a multiple of 128": (
        _args(x=_rows(200)),
        "D=200 is not a multiple of 128 in (128, 3968] (aten's one-warp mean)",
    ),
    "D of 4096 (aten splits the row)": (
        _args(x=_rows(4096)),
        "D=4096 is not a multiple of 128 in (128, 3968] (aten's one-warp mean)",
    ),
    "too few rows (aten spreads a row over more warps)": (
        _args(x=as_cuda(torch.zeros(1, 15, D, dtype=BF16))),
        "15 rows: aten's mean sums a row in one warp from 16 rows",
    ),
    "eps not a number": (_args(eps=None), "eps is not a number"),
    "nothing to compute": (
        _args(weight=None, scale=None, update=None, update_weight=None, gate=None),
        "a call needs an update or a next norm",
    ),
    "gate without an update": (_args(update=None, update_weight=None), "a gate needs an update"),
    "scale without a norm": (_args(weight=None), "a scale needs a next norm"),
    "update without its weight": (_args(update_weight=None), "an update needs its norm's weight"),
    "weight not a tensor": (_args(weight=1.0), "weight is not a tensor"),
    "weight in fp32": (
        _args(weight=_vec(dtype=torch.float32)),
        "weight is torch.float32 on cuda:0, x torch.bfloat16 on cuda:0 (eager would promote)",
    ),
    "weight of another width": (_args(weight=_vec(128)), "weight must be a dense [256] vector, got (128,)"),
    "gate not a tensor": (_args(gate=0.5), "gate is not a tensor"),
    "gate in fp16": (
        _args(gate=_batch_rows(dtype=torch.float16)),
        "gate is torch.float16 on cuda:0, x torch.bfloat16 on cuda:0 (eager would promote)",
    ),
    "scale per token": (_args(scale=_rows()), "scale must be contiguous [2, 1, 256], got (2, 9, 256)"),
    "update not a tensor": (_args(update=2.0), "update is not a tensor"),
    "update of another shape": (
        _args(update=as_cuda(torch.zeros(2, 10, D, dtype=BF16))),
        "update (2, 10, 256) torch.bfloat16 differs from x's (2, 9, 256) torch.bfloat16",
    ),
    "update strided": (
        _args(update=as_cuda(torch.zeros(2, 9, 2 * D, dtype=BF16)[..., D:])),
        "update is not contiguous",
    ),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.usefixtures("accept_runtime")
def test_decline_reason(name: str) -> None:
    args, expected = CASES[name]
    reason = sandwich_norm.decline_reason(*args)
    assert reason == expected
    assert sandwich_norm.fused(*args) is None
    error = TypeError if isinstance(reason, TypeReason) else ValueError
    with pytest.raises(error, match=f"^{re.escape('flux2-fused: ' + expected)}$"):
        sandwich_norm.sandwich_norm(*args)


# What the quantizing form (out as torchao's per-row float8) declines besides the plain kernel's cases.
QUANTIZED_CASES: dict[str, tuple[tuple[Any, ...], str]] = {
    "the block's last update (no next norm)": (
        _args(weight=None, scale=None),
        "the quantizing form needs a next norm",
    ),
}


def test_every_decline_reason_has_a_case() -> None:
    reasons = [reason for _, reason in (*CASES.values(), *QUANTIZED_CASES.values())]
    missing = untested(reason_templates(guards), reasons)
    assert not missing, f"decline reasons without a test case: {missing}"


@pytest.mark.usefixtures("accept_runtime")
def test_the_quantizing_form_declines_what_the_kernel_declines(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain kernel's every decline first, then its own: a site without a next norm, and a GPU
    older than sm_89 (no float8 GEMMs), where it is not built; the sites with a next norm otherwise."""
    monkeypatch.setattr(runtime, "capability", lambda device: (9, 0))
    for name, (args, expected) in {**CASES, **QUANTIZED_CASES}.items():
        assert sandwich_norm.quantized_reason(*args) == expected, name
        assert sandwich_norm.quantized(*args) is None, name
    x, w, eps, scale, update, uw, gate = _args()
    for args in (
        (x, w, eps, scale),
        (x, w, eps, scale, update, uw, gate),
        (x, w, eps, None, update, uw, None),
    ):
        assert sandwich_norm.quantized_reason(*args) is None
    monkeypatch.setattr(runtime, "capability", lambda device: (8, 0))
    reason = "the quantizing kernel needs sm_89 or newer (float8 GEMMs)"
    assert sandwich_norm.quantized_reason(x, w, eps, scale) == reason
    assert sandwich_norm.quantized(x, w, eps, scale) is None


@pytest.mark.usefixtures("accept_runtime")
def test_accepts_every_site_z_image_calls() -> None:
    """The first norm (with or without a scale), the gated update with the next norm, the last update
    alone, a shared gate and scale, the widest D."""
    x, w, eps, scale, update, uw, gate = _args()
    for args in (
        (x, w, eps, scale),
        (x, w, eps),
        (x, w, eps, scale, update, uw, gate),
        (x, None, eps, None, update, uw, gate),
        (x, w, eps, None, update, uw, None),
        (x, w, eps, _batch_rows(1), update, uw, _batch_rows(1)),
        (_rows(3968), _vec(3968), eps),
    ):
        assert sandwich_norm.decline_reason(*args) is None


@pytest.mark.usefixtures("accept_runtime")
def test_misaligned_and_autograd_decline() -> None:
    x = as_cuda(misaligned(2, 9, D))
    assert sandwich_norm.decline_reason(*_args(x=x)) == "x data pointer is not 8-byte aligned"
    w = as_cuda(torch.ones(D, dtype=BF16, requires_grad=True))
    assert (
        sandwich_norm.decline_reason(*_args(weight=w))
        == "weight requires grad and the fused kernel has no backward"
    )


def test_each_width_and_dtype_asks_its_own_self_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """aten's reduction depends on D: a verdict for one width never vouches for another."""
    monkeypatch.setattr(runtime, "_records", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(
        runtime,
        "_check",
        lambda op, device, config: runtime.CheckRecord(config.hidden == 256, str(config), 0),
    )
    assert sandwich_norm.decline_reason(*_args()) is None
    assert sandwich_norm.decline_reason(_rows(384), _vec(384), 1e-5) == "self-check failed: D=384 bfloat16"
    assert str(Config(torch.float16)) == "D=3840 float16"
    assert str(Config(torch.bfloat16, quantized="row")) == "D=3840 bfloat16 quantized per row"


def test_the_cpu_runs_the_eager_chain() -> None:
    """On the CPU the entry point is the reference, with the switch on or off."""
    x, update = torch.randn(2, 9, D).to(BF16), torch.randn(2, 9, D).to(BF16)
    w, uw = torch.randn(D).to(BF16), torch.randn(D).to(BF16)
    gate, scale = torch.randn(2, 1, D).to(BF16), torch.randn(2, 1, D).to(BF16)
    expected = sandwich_norm.reference.sandwich(x, w, 1e-5, scale, update, uw, gate)
    for enabled in (True, False):
        got = sandwich_norm.apply(x, w, 1e-5, scale, update, uw, gate, enabled=enabled)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
