"""`bench.denoise.plan` asks the ops' one answer for whether the fused mode runs kernels: on the
prebuilt wheel (bundled modules, no toolkit) it does, and an op without a module is named; where it
does not, the two modes' op counts differ only as `reading_notes` says."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from flux2_fused.bench.denoise import BenchRequest, build_model, euler_step, make_inputs, plan
from flux2_fused.bench.results.tables import MODES
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
    p = _plan(
        monkeypatch,
        {"swiglu", "gated_resnorm", "qk_norm_rope", "sandwich_norm", "float8_quant", "uniform_rows"},
    )
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the modes' op counts where the fast path is off")
def test_without_the_fast_path_the_modes_differ_only_in_joining_a_single_blocks_halves() -> None:
    """What `reading_notes` says of the op counts: both modes run the same arithmetic; the fused mode's
    code writes each single block's two halves into one buffer where eager calls `cat` once."""
    p = plan(BenchRequest(config="tiny", height=64, width=64, text_tokens=8))
    model = build_model(p)
    noise, inputs = make_inputs(p.config, p)
    counts = {}
    for mode in MODES:
        model.fused = mode == "fused"
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            euler_step(model, noise, inputs, 1.0, 0.5)
        counts[mode] = Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
    differ = set((counts["eager"] - counts["fused"]) + (counts["fused"] - counts["eager"]))
    buffer_ops = {"aten::cat", "aten::narrow", "aten::empty", "aten::new_empty", "aten::copy_"}
    assert differ and differ <= buffer_ops | {"aten::slice", "aten::as_strided"}
    assert counts["eager"]["aten::cat"] - counts["fused"]["aten::cat"] == p.config.num_single_layers
