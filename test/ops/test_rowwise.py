"""CPU tests of what the row-wise ops share (`ops/rowwise.py`): the quantizing form's outputs, guards
and verdicts, by granularity."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.ops import swiglu
from flux2_fused.ops.rowwise import Config, joint_outputs, quantized_outputs

from .conftest import as_cuda


def test_the_joint_form_gets_contiguous_rows_and_a_word_a_row() -> None:
    """Whatever x's layout (here a strided view), the joint rows are a fresh contiguous [..., width]
    of x's dtype, and the words one int32 a row."""
    x = torch.zeros(2, 5, 64, dtype=torch.float16)[..., 16:]
    joint, words = joint_outputs(x, 40)
    assert joint.shape == (2, 5, 40) and joint.dtype == x.dtype and joint.is_contiguous()
    assert words.shape == (10,) and words.dtype == torch.int32
    q, scale = quantized_outputs(x, 40)
    assert (q.shape, q.dtype, scale.shape, scale.dtype) == (
        (2, 5, 40),
        torch.float8_e4m3fn,
        (2, 5, 1),
        torch.float32,
    )


def test_each_granularity_has_its_own_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """The quantizing form asks the self-check of its granularity's kernel: per row the quantizing
    epilogue, per tensor the joint form (with float8_quant after it)."""
    from flux2_fused.ops import runtime

    asked: list[str] = []

    def check(op, device, config):
        asked.append(str(config))
        return runtime.CheckRecord(config.quantized == "row", str(config), 0)

    monkeypatch.setattr(runtime, "_records", {})
    monkeypatch.setattr(runtime, "_check", check)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(runtime, "capability", lambda device: (9, 0))
    x = as_cuda(torch.zeros(2, 5, 32, dtype=torch.bfloat16))
    guards = swiglu.guards.rows
    assert guards.quantized_reason(x) is None
    assert (
        guards.quantized_reason(x, granularity="tensor") == "self-check failed: bfloat16 quantized per tensor"
    )
    assert asked == ["bfloat16 quantized per row", "bfloat16 quantized per tensor"]
    assert str(Config(torch.float16)) == "float16"


def test_a_quantizing_call_names_one_granularity_and_one_second_operand() -> None:
    x = as_cuda(torch.zeros(2, 5, 32, dtype=torch.bfloat16))
    guards = swiglu.guards.rows
    with pytest.raises(ValueError, match="granularity 'block' is not one of row, tensor"):
        guards.quantized_reason(x, granularity="block")
    with pytest.raises(ValueError, match="a prefix or b, not both"):
        guards.quantized_reason(x, x, x)
