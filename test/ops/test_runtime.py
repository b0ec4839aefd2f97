"""`runtime.fast_path_reason`: the one answer to "is the fast path on here", on stand-in devices.

Each case stubs what a machine would report (CUDA present, the device's architecture and name, the
toolkit) and checks the one line a user sees.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from flux2_fused.ops import DISABLE_ENV, fast_path_reason, jit


def _gpu(monkeypatch: pytest.MonkeyPatch, arch: str = "9.0", toolchain: str | None = None) -> None:
    """A CUDA machine whose device 0 has `arch`, named 'Test GPU', with `toolchain` as its toolkit
    verdict (None: tvm-ffi and nvcc present)."""
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    monkeypatch.setattr(jit, "device_arch", lambda device: arch)
    monkeypatch.setattr(jit, "toolchain_reason", lambda: toolchain)


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
    "no toolkit": ("cuda", None, lambda mp: _gpu(mp, toolchain="nvcc not found"), "nvcc not found"),
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
