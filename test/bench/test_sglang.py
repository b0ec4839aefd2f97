"""The sglang harness's stubs: a package this environment lacks imports as stubs, any submodule
included, usable at import time (attributes, base classes) and raising as soon as it is called; and
only until `release_runtime`, after which the process imports as if no stub had ever been there."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest

from flux2_fused.bench import sglang as harness

ABSENT = "flux2_fused_absent_package"


def test_a_stubbed_package_imports_and_refuses_calls() -> None:
    harness._stub(ABSENT)
    try:
        module = importlib.import_module(f"{ABSENT}.quantization.kernels")
        from flux2_fused_absent_package import some_kernel  # type: ignore[import-not-found]

        class Derived(module.Base):  # a stubbed base class, as import-time code defines them
            pass

        assert Derived() is not None
        with pytest.raises(ImportError, match="stub"):
            some_kernel(1)
        with pytest.raises(AttributeError):
            module.__wrapped__  # noqa: B018  (dunders are not stubbed: inspect and pickle probe them)
    finally:
        harness.release_runtime()


def test_release_runtime_takes_the_stubs_away() -> None:
    """After `release_runtime` no stub finder is left on sys.meta_path and no stub module in
    sys.modules: importing the stubbed name fails again, as it did before the stub (a later import of
    torchvision in the same process, say, must not get a stub)."""
    harness._stub(ABSENT)
    importlib.import_module(f"{ABSENT}.sub")
    assert importlib.util.find_spec(ABSENT) is not None
    harness.release_runtime()
    assert not [finder for finder in sys.meta_path if isinstance(finder, harness._StubFinder)]
    assert not [name for name in sys.modules if name.split(".")[0] == ABSENT]
    assert importlib.util.find_spec(ABSENT) is None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"{ABSENT}.sub")
