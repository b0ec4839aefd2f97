"""The sglang harness's stubs: a package this environment lacks imports as stubs, any submodule
included, usable at import time (attributes, base classes) and raising as soon as it is called."""

from __future__ import annotations

import importlib
import sys

import pytest

from flux2_fused.bench import sglang as harness


def test_a_stubbed_package_imports_and_refuses_calls() -> None:
    name = "flux2_fused_absent_package"
    harness._stub(name)
    try:
        module = importlib.import_module(f"{name}.quantization.kernels")
        from flux2_fused_absent_package import some_kernel  # type: ignore[import-not-found]

        class Derived(module.Base):  # a stubbed base class, as import-time code defines them
            pass

        assert Derived() is not None
        with pytest.raises(ImportError, match="stub"):
            some_kernel(1)
        with pytest.raises(AttributeError):
            module.__wrapped__  # noqa: B018  (dunders are not stubbed: inspect and pickle probe them)
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "package", None) != name]
        for key in [key for key in sys.modules if key.startswith(name)]:
            del sys.modules[key]
