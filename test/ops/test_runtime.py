"""`runtime.fast_path_reason` and `module_sources`: the one answer to "is the fast path on here" and
"where does each op's module come from", on stand-in devices.

Each case stubs what a machine would report (CUDA present, the device's architecture and name, the
toolkit, the bundled modules) and checks what a user sees.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from flux2_fused.ops import DISABLE_ENV, OPS, fast_path_reason, jit
from flux2_fused.ops.runtime import module_sources


def _gpu(monkeypatch: pytest.MonkeyPatch, arch: str = "9.0", toolchain: str | None = None) -> None:
    """A CUDA machine whose device 0 has `arch`, named 'Test GPU', with `toolchain` as its toolkit
    verdict (None: tvm-ffi and nvcc present) and no module loaded yet."""
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    monkeypatch.setattr(jit, "device_arch", lambda device: arch)
    monkeypatch.setattr(jit, "toolchain_reason", lambda: toolchain)
    monkeypatch.setattr(jit, "_origins", {})


# name -> (device, dtype, setup, the reason)
CASES: dict[str, tuple[str, torch.dtype | None, Callable[[pytest.MonkeyPatch], None], str | None]] = {
    "on": ("cuda", torch.bfloat16, _gpu, None),
    "cpu": ("cpu", torch.bfloat16, _gpu, "the fused ops run on CUDA GPUs, not on cpu"),
    "no gpu": (
        "cuda",
        None,
        lambda mp: mp.setattr(torch.cuda, "is_available", lambda: False),
        "no CUDA GPU is available",
    ),
    "too old": (
        "cuda",
        torch.float16,
        lambda mp: _gpu(mp, arch="7.5"),
        "Test GPU: compute capability 7.5 is older than the kernels' minimum 8.0 (sm_80)",
    ),
    "fp32": ("cuda", torch.float32, _gpu, "the kernels compute in bf16 and fp16, not float32"),
    "kill switch": (
        "cuda",
        torch.bfloat16,
        lambda mp: (_gpu(mp), mp.setenv(DISABLE_ENV, "1")),
        f"disabled by {DISABLE_ENV}",
    ),
}
REASONS = [reason for *_, reason in CASES.values() if reason is not None]


@pytest.mark.parametrize("name", CASES)
def test_fast_path_reason(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    device, dtype, setup, expected = CASES[name]
    setup(monkeypatch)
    assert fast_path_reason(device, dtype) == expected


def test_the_minimum_architecture() -> None:
    assert jit.MIN_CAPABILITY == (8, 0)
    assert jit.arch_reason("8.0") is None and jit.arch_reason("sm_90a") is None
    assert jit.arch_reason("7.5") == "compute capability 7.5 is older than the kernels' minimum 8.0 (sm_80)"


def test_an_old_gpu_is_never_built_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device older than sm_80 fails its module lookup with the reason, before any build."""
    monkeypatch.setattr(jit, "_device_arch", {})
    monkeypatch.setattr(jit, "device_arch", lambda device: "7.5")
    monkeypatch.setattr(jit, "load_module", lambda spec, arch: pytest.fail("nothing may be built"))
    with pytest.raises(jit.BuildError, match="older than the kernels' minimum"):
        jit.module_for(object(), torch.device("cuda", 0))


def stand_in_bundle(monkeypatch: pytest.MonkeyPatch, ops: set[str]) -> None:
    """A GPU (sm 9.0) without a toolkit on which the ops named in `ops` have a bundled module."""
    _gpu(monkeypatch, toolchain="nvcc not found")
    monkeypatch.setattr(jit, "_origins", {})
    monkeypatch.setattr(jit, "loader_reason", lambda: None)
    monkeypatch.setattr(
        jit, "bundled_library", lambda spec, arch: Path(f"{spec.name}.so") if spec.name in ops else None
    )


def test_a_bundled_module_needs_no_toolkit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prebuilt wheel's case: no nvcc, every op bundled; the fast path is on, and each op's
    module is said to come from the bundle."""
    stand_in_bundle(monkeypatch, {op.name for op in OPS})
    assert fast_path_reason("cuda", torch.bfloat16) is None
    assert module_sources("cuda") == {op.name: (f"bundled ({op.spec.name}.so)", None) for op in OPS}


def test_a_partial_bundle_says_which_ops_have_no_module(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in_bundle(monkeypatch, {"swiglu"})
    assert fast_path_reason("cuda", torch.bfloat16) is None
    sources = module_sources("cuda")
    assert sources["swiglu"] == ("bundled (swiglu.so)", None)
    assert sources["gated_resnorm"] == (None, "no bundled module for sm 9.0, and nvcc not found")


def test_no_bundle_and_no_toolkit_turns_the_fast_path_off(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in_bundle(monkeypatch, set())
    assert fast_path_reason("cuda") == "no bundled module for sm 9.0, and nvcc not found"


def test_with_a_toolkit_the_source_is_the_cache_or_a_build(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in_bundle(monkeypatch, set())
    monkeypatch.setattr(jit, "toolchain_reason", lambda: None)
    monkeypatch.setattr(jit, "is_cached", lambda spec, archs: spec.name == "swiglu")
    sources = module_sources("cuda")
    assert sources["swiglu"] == ("cache", None) and sources["gelu_tanh"] == ("JIT build", None)


def test_a_loaded_module_reports_where_it_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in_bundle(monkeypatch, set())
    spec = OPS[0].spec
    monkeypatch.setitem(jit._origins, (spec, "9.0"), "built now")
    assert jit.module_source(spec, "9.0") == ("built now", None)
    monkeypatch.setitem(jit._origins, (spec, "9.0"), "unavailable: the build failed")
    assert jit.module_source(spec, "9.0") == (None, "the build failed")
