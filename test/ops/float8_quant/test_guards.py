"""The float8 quantization guards: every decline reason has a case (and its exact message), the
validated op raises TypeError or ValueError with it, the entry point runs the eager chain for what it
declines, and the verdicts are per (dtype, granularity)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from flux2_fused.ops import float8_quant, runtime
from flux2_fused.ops.float8_quant import Config, guards
from flux2_fused.ops.float8_quant.selfcheck import same
from flux2_fused.ops.verdicts import TypeReason

from ..conftest import as_cuda, misaligned, reason_templates, untested

BF16, K = torch.bfloat16, 64


def _rows(k: int = K, dtype: torch.dtype = BF16) -> torch.Tensor:
    return as_cuda(torch.randn(2, 9, k).to(dtype))


CASES: dict[str, tuple[tuple[Any, ...], str]] = {
    "x not a tensor": (([1.0],), "x is not a tensor"),
    "granularity": ((_rows(), "block"), "granularity 'block' is not one of row, tensor"),
    "x on the CPU": ((torch.zeros(2, 9, K, dtype=BF16),), "x is on cpu, the fused kernel needs CUDA"),
    "x in fp32": ((_rows(dtype=torch.float32),), "dtype torch.float32 is not supported (bfloat16, float16)"),
    "no rows": ((as_cuda(torch.zeros(0, K, dtype=BF16)),), "x (0, 64) has no rows"),
    "x strided": ((as_cuda(torch.zeros(2, 9, 2 * K, dtype=BF16)[..., :K]),), "x is not contiguous"),
    "K not a multiple of 8": ((_rows(60), "tensor"), "K=60 is not a multiple of 8"),
    "K too wide for a block": ((_rows(24584),), "K=24584 is more than 24576, the widest row a block holds"),
    "words with a scale a row": (
        (_rows(), "row", as_cuda(torch.zeros(18, dtype=torch.int32))),
        "amax words are a whole-tensor scale's",
    ),
    "words not a tensor": ((_rows(), "tensor", [0] * 18), "words is not a tensor"),
    "words in int64": (
        (_rows(), "tensor", as_cuda(torch.zeros(18, dtype=torch.int64))),
        "words are torch.int64 on cuda:0, need int32 on cuda:0",
    ),
    "words strided": (
        (_rows(), "tensor", as_cuda(torch.zeros(36, dtype=torch.int32)[::2])),
        "words (18,) are not one contiguous run of words",
    ),
    "no words": (
        (_rows(), "tensor", as_cuda(torch.zeros(0, dtype=torch.int32))),
        "words (0,) are not one contiguous run of words",
    ),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.usefixtures("accept_runtime")
def test_decline_reason(name: str) -> None:
    args, expected = CASES[name]
    reason = float8_quant.decline_reason(*args)
    assert reason == expected
    assert not guards.accepts(*args)
    assert float8_quant.fused(*args) is None
    error = TypeError if isinstance(reason, TypeReason) else ValueError
    with pytest.raises(error, match=f"^{re.escape('flux2-fused: ' + expected)}$"):
        float8_quant.float8_quant(*args)
    if len(args) == 3:  # the entry point runs the eager chain without them
        assert float8_quant.apply(*args[:2], words=args[2]) is not None


def test_every_decline_reason_has_a_case() -> None:
    missing = untested(reason_templates(guards), [reason for _, reason in CASES.values()])
    assert not missing, f"decline reasons without a test case: {missing}"


@pytest.mark.usefixtures("accept_runtime")
def test_accepts_the_activations_of_a_transformer() -> None:
    """[B, S, K] and [M, K] rows, both granularities, the widest K."""
    for args in (
        (_rows(),),
        (_rows(), "tensor"),
        (_rows(), "tensor", as_cuda(torch.zeros(18, dtype=torch.int32))),
        (as_cuda(torch.randn(9, K).to(BF16)),),
        (_rows(24576),),
        (_rows(24584), "tensor"),
        (_rows(dtype=torch.float16),),
    ):
        assert float8_quant.decline_reason(*args) is None
        assert guards.accepts(*args)  # the memoized guard the entry point asks, alike


@pytest.mark.usefixtures("accept_runtime")
def test_misaligned_and_autograd_decline() -> None:
    x = as_cuda(torch.zeros(2 * 9 * K + 4, dtype=BF16)[4:].view(2, 9, K))
    assert float8_quant.decline_reason(x) == "x data pointer is not 16-byte aligned"
    assert (
        float8_quant.decline_reason(as_cuda(misaligned(2, 9, K))) == "x data pointer is not 16-byte aligned"
    )
    grad = as_cuda(torch.ones(2, 9, K, dtype=BF16, requires_grad=True))
    assert float8_quant.decline_reason(grad) == "x requires grad and the fused kernel has no backward"


def test_each_granularity_and_dtype_asks_its_own_self_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "_records", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(
        runtime,
        "_check",
        lambda op, device, config: runtime.CheckRecord(config.granularity == "row", str(config), 0),
    )
    assert float8_quant.decline_reason(_rows()) is None
    assert float8_quant.decline_reason(_rows(), "tensor") == "self-check failed: bfloat16 per tensor"
    assert str(Config(torch.float16)) == "float16 per row"


def test_the_cpu_runs_the_eager_chain() -> None:
    x = torch.randn(2, 9, K).to(BF16)
    for granularity in ("row", "tensor"):
        expected = float8_quant.reference.quantize(x, granularity)
        for enabled in (True, False):
            assert same(float8_quant.apply(x, granularity, enabled=enabled), expected)
    words = torch.zeros(18, dtype=torch.int32)  # not the amax: the eager chain never reads them
    assert same(float8_quant.apply(x, "tensor", words=words), float8_quant.reference.quantize(x, "tensor"))
