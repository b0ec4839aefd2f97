"""Build hooks. The package is pure Python and its kernels are built on first use (JIT), unless the
wheel is built with FLUX2_FUSED_BUNDLE_KERNELS=1: then every kernel is compiled into the wheel
(`flux2_fused/ops/prebuilt/`, see `flux2_fused/ops/bundle.py`) and the wheel is tagged for the
platform those modules are linked for (manylinux_2_28). Build it from an environment that has the
package's dependencies, a CUDA toolkit and zig's linker (`pip install ziglang`):

    FLUX2_FUSED_BUNDLE_KERNELS=1 pip wheel --no-deps --no-build-isolation -w dist .
"""

import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

BUNDLE = os.environ.get("FLUX2_FUSED_BUNDLE_KERNELS") == "1"
if BUNDLE:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "python"))


class BuildPyWithKernels(build_py):
    """build_py, then (when bundling) every op's prebuilt module into the build tree."""

    def run(self) -> None:
        super().run()
        if BUNDLE:
            from flux2_fused.ops.bundle import build_bundle

            build_bundle(Path(self.build_lib) / "flux2_fused" / "ops" / "prebuilt")


cmdclass = {"build_py": BuildPyWithKernels}
options = {}
if BUNDLE:
    from setuptools.command.bdist_wheel import bdist_wheel
    from setuptools.dist import Distribution

    class BinaryDistribution(Distribution):
        """A distribution with machine code: installed to platlib, the wheel's root."""

        def has_ext_modules(self) -> bool:
            return True

    class PlatformWheel(bdist_wheel):
        """Tagged py3-none-<platform>: the bundled modules are machine code, not tied to a Python
        version (they talk to Python only through tvm-ffi's C ABI)."""

        def get_tag(self) -> tuple[str, str, str]:
            from flux2_fused.ops.bundle import PLATFORM

            return "py3", "none", PLATFORM

    cmdclass["bdist_wheel"] = PlatformWheel
    options["distclass"] = BinaryDistribution

setup(cmdclass=cmdclass, **options)
