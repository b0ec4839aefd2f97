"""`bench.denoise.plan` asks the ops' one answer for whether the fused mode runs kernels: on the
prebuilt wheel (bundled modules, no toolkit) it does, and an op without a module is named."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.bench.denoise import BenchRequest, plan
from flux2_fused.ops import OPS

from ..ops.test_runtime import stand_in_bundle


def _plan(monkeypatch: pytest.MonkeyPatch, bundled: set[str]):
    stand_in_bundle(monkeypatch, bundled)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return plan(BenchRequest(config="tiny", height=256, width=256))


def test_the_bundle_without_a_toolkit_runs_the_fused_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    p = _plan(monkeypatch, {op.name for op in OPS})
    assert p.fast_path_off is None
    assert not any("eager" in note for note in p.notes)


def test_an_op_without_a_module_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    p = _plan(monkeypatch, {"swiglu", "gated_resnorm", "qk_norm_rope"})
    assert p.fast_path_off is None
    assert [note for note in p.notes if "eager" in note] == [
        "gelu_tanh runs eager in the fused mode: no module for it here "
        "(no bundled module for sm 9.0, and nvcc not found)"
    ]


def test_no_module_at_all_turns_the_fused_mode_off(monkeypatch: pytest.MonkeyPatch) -> None:
    p = _plan(monkeypatch, set())
    assert p.fast_path_off == (
        "the fast path is off here (no bundled module for sm 9.0, and nvcc not found): "
        "both modes run eager PyTorch"
    )
