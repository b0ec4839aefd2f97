"""CPU tests of the JIT build: real compiles for sm_90 and sm_100, the cache key, and every failure mode.

Two real compiles (~15 s each) are shared by a module-scoped fixture and skipped only where no nvcc
is found. Everything else runs on a fake compiler standing in for tvm_ffi.cpp.build (it writes a
small fake library), so the failure modes cost milliseconds and need no CUDA toolkit.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import tvm_ffi
import tvm_ffi.cpp

from flux2_fused.ops import OPS, FusedOp, jit, runtime
from flux2_fused.ops.gated_resnorm import guards
from flux2_fused.ops.gated_resnorm.launch import SPEC

from .fatbin import fatbin_targets

PACKAGE_ROOT = Path(jit.__file__).resolve().parents[2]  # the folder holding flux2_fused
FAKE_NVCC = "/opt/fake-cuda/bin/nvcc"


def digest_matches(lib: Path) -> bool:
    """The published library's SHA-256 equals its sidecar (computed here, not by jit)."""
    return hashlib.sha256(lib.read_bytes()).hexdigest() == lib.with_suffix(".sha256").read_text().strip()


def leftovers(folder: Path) -> list[str]:
    """Anything in a cache folder other than a finished library, its digest and the lock file."""
    finished = (SPEC.library, Path(SPEC.library).with_suffix(".sha256").name, ".lock")
    return sorted(p.name for p in folder.iterdir() if p.name not in finished)


# --------------------------------------------------------------------------- fake compiler


@dataclass
class FakeCompiler:
    """Stands in for tvm_ffi.cpp.build: writes a small fake library, or raises `fail`.

    `calls` holds the target list ($TVM_FFI_CUDA_ARCH_LIST) each build was given.
    """

    calls: list[str | None] = field(default_factory=list)
    fail: Exception | None = None

    def __call__(self, name: str, *, build_directory: str, **kwargs: Any) -> str:
        self.calls.append(os.environ.get("TVM_FFI_CUDA_ARCH_LIST"))
        if self.fail is not None:
            raise self.fail
        out = Path(build_directory) / f"{name}.so"
        out.write_bytes(b"\x7fELF fake flux2-fused library, build %d\n" % len(self.calls) * 64)
        return str(out)


@pytest.fixture
def fake_compiler(monkeypatch: pytest.MonkeyPatch) -> FakeCompiler:
    """A fake nvcc and compiler; the cache key still covers the real sources and flags."""
    compiler = FakeCompiler()
    monkeypatch.setattr(tvm_ffi.cpp, "build", compiler)
    monkeypatch.setattr(jit, "find_nvcc", lambda: FAKE_NVCC)
    monkeypatch.setattr(jit, "_nvcc_version", lambda nvcc: "fake nvcc 0.0")
    return compiler


@pytest.fixture
def fresh_load_module() -> Iterator[None]:
    """load_module memoizes per module and architecture; a test that calls it starts and ends with an
    empty memo."""
    jit._loaded.clear()
    yield
    jit._loaded.clear()


# --------------------------------------------------------------------------- architectures


@pytest.mark.parametrize(
    ("arch", "expected"),
    [
        ("9.0", "9.0"),
        ("90", "9.0"),
        ("sm_90", "9.0"),
        ("SM_90", "9.0"),
        ("compute_90", "9.0"),
        ("9.0a", "9.0a"),
        ("sm_90a", "9.0a"),
        ("10.0", "10.0"),
        ("100", "10.0"),
        (" sm_100a ", "10.0a"),
        ("89", "8.9"),
        ("120", "12.0"),
    ],
)
def test_normalize_arch(arch: str, expected: str) -> None:
    assert jit.normalize_arch(arch) == expected


@pytest.mark.parametrize(
    "arch", ["", "9", "sm_9", "a", "sm_", "9.x", "9.", ".0", "9.0b", "1.2.3", "-9.0", "ninety"]
)
def test_normalize_arch_rejects(arch: str) -> None:
    with pytest.raises(ValueError, match="unrecognized CUDA architecture"):
        jit.normalize_arch(arch)


def test_build_needs_an_architecture(tmp_path: Path) -> None:
    with pytest.raises(jit.BuildError, match="no CUDA architecture given"):
        jit.build(SPEC, [], cache_dir=tmp_path)
    with pytest.raises(ValueError, match="unrecognized CUDA architecture 'ninety'"):
        jit.build(SPEC, ["ninety"], cache_dir=tmp_path)


def test_build_passes_each_architecture_once(fake_compiler: FakeCompiler, tmp_path: Path) -> None:
    jit.build(SPEC, ["9.0", "sm_90", "90"], cache_dir=tmp_path)
    jit.build(SPEC, ["sm_100a", "9.0"], cache_dir=tmp_path)
    assert fake_compiler.calls == ["9.0", "10.0a 9.0"]


# --------------------------------------------------------------------------- cache key


@pytest.fixture
def sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A private copy of the kernel sources that jit reads instead of the package's."""
    copy = tmp_path / "csrc"
    shutil.copytree(jit.CSRC, copy)
    monkeypatch.setattr(jit, "CSRC", copy)
    return copy


def test_cache_key_changes_with_arch_and_source_bytes(sources: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jit, "_nvcc_version", lambda nvcc: "fake nvcc 0.0")
    key = jit.cache_key(SPEC, ["9.0"], FAKE_NVCC)
    name, digest = key.rsplit("-", 1)
    assert name == SPEC.name and len(digest) == 24 and int(digest, 16) >= 0
    assert jit.cache_key(SPEC, ["9.0"], FAKE_NVCC) == key  # deterministic
    keys = {key, jit.cache_key(SPEC, ["10.0"], FAKE_NVCC), jit.cache_key(SPEC, ["9.0a"], FAKE_NVCC)}
    keys.add(jit.cache_key(SPEC, ["10.0", "9.0"], FAKE_NVCC))
    assert len(keys) == 4
    for name in (*SPEC.sources, *SPEC.headers):
        original = (sources / name).read_bytes()
        (sources / name).write_bytes(original + b"\n")  # one byte of whitespace
        assert jit.cache_key(SPEC, ["9.0"], FAKE_NVCC) != key, name
        (sources / name).write_bytes(original)
    assert jit.cache_key(SPEC, ["9.0"], FAKE_NVCC) == key


def _included(name: str) -> set[str]:
    """The files `name` includes from the kernel folder, transitively."""
    found: set[str] = set()
    for line in (jit.CSRC / name).read_text().splitlines():
        match = re.match(r'#include "([^"]+)"', line.strip())
        if match and match[1] not in found:
            found |= {match[1]} | _included(match[1])
    return found


@pytest.mark.parametrize("op", [op.name for op in OPS])
def test_every_spec_names_every_file_its_module_is_built_from(op: str) -> None:
    """The cache key digests the spec's files only: a header a source includes but the spec leaves
    out would leave a stale build in use after that header changes."""
    spec = next(o.spec for o in OPS if o.name == op)
    built_from = set(spec.sources).union(*(_included(source) for source in spec.sources))
    assert set(spec.sources) | set(spec.headers) == built_from


def test_cache_key_changes_with_flags_and_toolchain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jit, "_nvcc_version", lambda nvcc: "fake nvcc 0.0")
    key = jit.cache_key(SPEC, ["9.0"], FAKE_NVCC)
    monkeypatch.setattr(jit, "_nvcc_version", lambda nvcc: "fake nvcc 0.1")
    assert jit.cache_key(SPEC, ["9.0"], FAKE_NVCC) != key
    monkeypatch.setattr(jit, "_nvcc_version", lambda nvcc: "fake nvcc 0.0")
    monkeypatch.setattr(jit, "CUDA_FLAGS", (*jit.CUDA_FLAGS, "--use_fast_math"))
    assert jit.cache_key(SPEC, ["9.0"], FAKE_NVCC) != key


def test_a_source_change_builds_into_a_new_folder(
    fake_compiler: FakeCompiler, sources: Path, tmp_path: Path
) -> None:
    first = jit.build(SPEC, ["9.0"], cache_dir=tmp_path / "cache")
    (sources / "gated_resnorm.cuh").write_bytes((sources / "gated_resnorm.cuh").read_bytes() + b"\n")
    second = jit.build(SPEC, ["9.0"], cache_dir=tmp_path / "cache")
    assert first.parent != second.parent and digest_matches(first) and digest_matches(second)
    assert len(fake_compiler.calls) == 2


# --------------------------------------------------------------------------- real compiles


@pytest.fixture(scope="module")
def nvcc() -> str:
    """The real nvcc; tests that compile skip without one (CPU CI images may lack the toolkit)."""
    found = jit.find_nvcc()
    if found is None:
        pytest.skip("no CUDA toolkit (nvcc) found via $CUDA_HOME, $CUDA_PATH, /usr/local/cuda or PATH")
    return found


@dataclass(frozen=True)
class RealBuilds:
    sources: Path  # the snapshot of the kernel sources that was compiled
    libs: dict[str, Path]  # arch -> library


@pytest.fixture(scope="module")
def real_builds(nvcc: str, tmp_path_factory: pytest.TempPathFactory) -> RealBuilds:
    """The kernel compiled by nvcc for sm_90 and sm_100 into one fresh cache (~15 s each).

    From a snapshot of the sources, so that a file saved during the run cannot give the two
    architectures (or a later cache lookup) different keys.
    """
    snapshot = tmp_path_factory.mktemp("csrc")
    shutil.copytree(jit.CSRC, snapshot, dirs_exist_ok=True)
    cache = tmp_path_factory.mktemp("kernel-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jit, "CSRC", snapshot)
        return RealBuilds(
            snapshot, {arch: jit.build(SPEC, [arch], cache_dir=cache) for arch in ("9.0", "10.0")}
        )


@pytest.mark.parametrize(("arch", "sm"), [("9.0", "sm_90"), ("10.0", "sm_100")])
def test_real_build_targets_its_architecture(real_builds: RealBuilds, arch: str, sm: str) -> None:
    lib = real_builds.libs[arch]
    assert lib.read_bytes()[:4] == b"\x7fELF"
    assert digest_matches(lib)
    # The embedded fatbin holds machine code for this target only, read from its entry headers (a
    # large one is compressed, so the target's name need not appear in the raw bytes).
    assert fatbin_targets(lib) == {sm}
    assert leftovers(lib.parent) == []
    assert tvm_ffi.load_module(str(lib)).gated_resnorm is not None  # loads (no GPU needed) and exports


def test_real_build_is_cached(
    real_builds: RealBuilds, monkeypatch: pytest.MonkeyPatch, fresh_load_module: None
) -> None:
    """A second build, via $FLUX2_FUSED_CACHE_DIR this time, finds the library and compiles nothing."""
    lib = real_builds.libs["9.0"]
    monkeypatch.setattr(jit, "CSRC", real_builds.sources)
    monkeypatch.setenv(jit.CACHE_ENV, str(lib.parent.parent))
    monkeypatch.setattr(tvm_ffi.cpp, "build", FakeCompiler(fail=AssertionError("compiled again")))
    assert jit.build(SPEC, ["sm_90"]) == lib
    assert jit.load_module(SPEC, "9.0").gated_resnorm is not None


@pytest.mark.parametrize("op", [op for op in OPS if op.spec != SPEC], ids=lambda op: op.name)
def test_every_other_op_builds(nvcc: str, op: FusedOp, tmp_path: Path) -> None:
    """Every op's kernel compiles here, not only the one the tests above study (~10 s each, sm_90):
    its library loads without a GPU and exports the entry point named after the op."""
    lib = jit.build(op.spec, ["9.0"], cache_dir=tmp_path)
    assert digest_matches(lib)
    assert getattr(tvm_ffi.load_module(str(lib)), op.name) is not None


@pytest.mark.usefixtures("nvcc")
def test_real_compile_error_is_a_build_error(sources: Path, tmp_path: Path) -> None:
    """nvcc's own message reaches the user, and the failed build leaves nothing in the cache."""
    cu = sources / "gated_resnorm.cu"
    cu.write_text("#error flux2-fused test: deliberately broken\n" + cu.read_text())
    with pytest.raises(jit.BuildError, match="deliberately broken") as info:
        jit.build(SPEC, ["9.0"], cache_dir=tmp_path / "cache")
    assert "building the gated_resnorm kernel in" in str(info.value)
    (target,) = (tmp_path / "cache").iterdir()
    assert leftovers(target) == [] and not (target / SPEC.library).exists()


# --------------------------------------------------------------------------- nvcc missing


def test_find_cuda_home_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """$CUDA_HOME, $CUDA_PATH, the default folders, then nvcc on PATH; folders without nvcc are skipped."""
    homes = {}
    for name in ("home", "path", "default", "on-path"):
        exe = tmp_path / name / "bin" / "nvcc"
        exe.parent.mkdir(parents=True)
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
        homes[name] = tmp_path / name
    monkeypatch.setenv("PATH", str(homes["on-path"] / "bin"))
    monkeypatch.setattr(jit, "DEFAULT_CUDA_HOMES", (str(homes["default"]),))
    monkeypatch.setenv("CUDA_HOME", str(homes["home"]))
    monkeypatch.setenv("CUDA_PATH", str(homes["path"]))
    assert jit.find_cuda_home() == homes["home"]
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))  # no bin/nvcc there
    assert jit.find_cuda_home() == homes["path"]
    monkeypatch.delenv("CUDA_PATH")
    assert jit.find_cuda_home() == homes["default"]
    monkeypatch.setattr(jit, "DEFAULT_CUDA_HOMES", ())
    assert jit.find_cuda_home() == homes["on-path"]
    assert jit.find_nvcc() == str(homes["on-path"] / "bin" / "nvcc")


def test_a_toolkit_from_nvidias_pip_packages_is_found_last(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`pip install flux2-fused[jit]`: nvcc under the `nvidia` namespace package (CUDA 13's `cu13`),
    used where no other toolkit is found."""
    nvcc = tmp_path / "site" / "nvidia" / "cu13" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(jit, "DEFAULT_CUDA_HOMES", ())
    monkeypatch.setenv("PATH", str(tmp_path))
    assert tmp_path / "site" / "nvidia" / "cu13" in jit.pip_cuda_homes()
    assert jit.find_cuda_home() == tmp_path / "site" / "nvidia" / "cu13"


def test_a_toolkit_with_only_a_versioned_cudart_gets_a_link_for_the_linker(tmp_path: Path) -> None:
    """NVIDIA's pip runtime ships libcudart.so.13 only; tvm-ffi links `-lcudart`."""
    home = tmp_path / "cu13"
    (home / "lib").mkdir(parents=True)
    (home / "lib" / "libcudart.so.13").write_bytes(b"")
    dirs = jit.cudart_link_dirs(home, tmp_path / "work")
    link = dirs[-1] / "libcudart.so"
    assert link.is_symlink() and link.resolve() == (home / "lib" / "libcudart.so.13").resolve()
    (home / "lib64").mkdir()
    (home / "lib64" / "libcudart.so").write_bytes(b"")
    assert jit.cudart_link_dirs(home, tmp_path / "work2") == [home / "lib64", home / "lib"]


@pytest.fixture
def no_nvcc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No toolkit anywhere jit looks: no $CUDA_HOME/$CUDA_PATH, no default folder, an empty PATH, no
    NVIDIA pip packages."""
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(jit, "DEFAULT_CUDA_HOMES", ())
    monkeypatch.setattr(jit, "pip_cuda_homes", list)
    monkeypatch.setenv("PATH", str(tmp_path))


@pytest.mark.usefixtures("no_nvcc")
def test_nvcc_missing_is_a_build_error(tmp_path: Path) -> None:
    assert jit.find_nvcc() is None
    with pytest.raises(jit.BuildError, match=r"nvcc not found: no CUDA toolkit in \$CUDA_HOME"):
        jit.build(SPEC, ["9.0"], cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # nothing created before the toolchain was found


@pytest.mark.usefixtures("no_nvcc", "fresh_load_module")
def test_nvcc_missing_through_the_guards_is_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a user sees on a GPU box without a toolkit: one RuntimeWarning naming nvcc, then eager.

    The GPU-only steps around the build (device capability, graph-capture query) are stubbed; the
    self-check's build attempt itself is real.
    """
    monkeypatch.delenv(runtime.DISABLE_ENV, raising=False)
    monkeypatch.setattr(runtime, "_records", {})
    monkeypatch.setattr(runtime, "_warned", set())
    monkeypatch.setattr(jit, "_device_arch", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(jit, "device_arch", lambda device: "9.0")
    device = torch.device("cuda", 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reasons = {
            runtime.runtime_reason(guards.OP, device, guards.Config(dim, torch.bfloat16))
            for dim in (3072, 6144, 3072)
        }
    (reason,) = reasons  # every hidden size declines for the one failed build
    assert reason.startswith("self-check failed: BuildError: nvcc not found")
    (warning,) = caught
    assert warning.category is RuntimeWarning
    assert "nvcc not found" in str(warning.message) and str(warning.message).endswith("; using eager PyTorch")


# --------------------------------------------------------------------------- failing builds


def test_compiler_failure_is_a_build_error_and_leaves_nothing(
    fake_compiler: FakeCompiler, tmp_path: Path
) -> None:
    fake_compiler.fail = RuntimeError('ninja exited with status 1\nerror: identifier "foo" is undefined')
    with pytest.raises(jit.BuildError, match='identifier "foo" is undefined') as info:
        jit.build(SPEC, ["9.0"], cache_dir=tmp_path)
    assert info.value.__cause__ is fake_compiler.fail
    (target,) = tmp_path.iterdir()
    assert leftovers(target) == [] and not (target / SPEC.library).exists()


def test_failed_rebuild_does_not_keep_the_corrupt_library(
    fake_compiler: FakeCompiler, tmp_path: Path
) -> None:
    lib = jit.build(SPEC, ["9.0"], cache_dir=tmp_path)
    lib.write_bytes(lib.read_bytes()[:100])
    fake_compiler.fail = RuntimeError("nvcc died")
    with pytest.raises(jit.BuildError, match="nvcc died"):
        jit.build(SPEC, ["9.0"], cache_dir=tmp_path)
    assert not lib.exists() and not lib.with_suffix(".sha256").exists()


def test_copy_failing_half_way_leaves_no_partial_library(
    fake_compiler: FakeCompiler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk filling up while the library is copied into the cache."""

    def half_copy(src: str, dst: str | Path) -> None:
        Path(dst).write_bytes(Path(src).read_bytes()[:50])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", half_copy)
    with pytest.raises(jit.BuildError, match="No space left on device"):
        jit.build(SPEC, ["9.0"], cache_dir=tmp_path)
    (target,) = tmp_path.iterdir()
    assert leftovers(target) == [] and not (target / SPEC.library).exists()


# --------------------------------------------------------------------------- unwritable cache


def test_unwritable_cache_falls_back_to_one_reused_private_folder(
    fake_compiler: FakeCompiler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$FLUX2_FUSED_CACHE_DIR names a regular file (mkdir fails even for root, chmod would not): one
    warning, the build goes to the per-user fallback folder, and a later run reuses that build."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(jit, "_fallback_dirs", {})
    monkeypatch.setenv(jit.CACHE_ENV, str(blocker))
    with pytest.warns(RuntimeWarning, match="not a writable folder") as record:
        lib = jit.build(SPEC, ["9.0"])
    fallback = tmp_path / "tmp" / f"flux2-fused-cache-{os.getuid()}"
    assert lib.is_relative_to(fallback) and list((tmp_path / "tmp").iterdir()) == [fallback]
    assert fallback.stat().st_mode & 0o777 == 0o700
    message = str(record[0].message)
    assert str(blocker) in message and f"using {fallback} instead" in message and jit.CACHE_ENV in message
    assert digest_matches(lib)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same process again: no second warning, no second build
        assert jit.build(SPEC, ["9.0"]) == lib
    monkeypatch.setattr(jit, "_fallback_dirs", {})  # a later run: warned again, but built only once
    with pytest.warns(RuntimeWarning, match="not a writable folder"):
        assert jit.build(SPEC, ["9.0"]) == lib
    assert len(fake_compiler.calls) == 1


def test_fallback_folder_others_can_write_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A per-user fallback folder that is not private (someone made it world-writable) could hold
    their library: a fresh private folder is used instead and removed at exit."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    shared = tmp_path / f"flux2-fused-cache-{os.getuid()}"
    shared.mkdir()
    shared.chmod(0o777)
    fallback = jit.fallback_cache_dir()
    assert fallback != shared and fallback.parent == tmp_path and fallback.stat().st_mode & 0o077 == 0


# --------------------------------------------------------------------------- concurrent builds

CHILD = textwrap.dedent(
    """
    import importlib.util
    import os
    import sys
    import time
    import types
    from pathlib import Path

    cache, log, barrier, count = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])


    def slow_fake_build(name, *, build_directory, **kwargs):
        with open(log, "a") as fh:
            fh.write(f"{os.getpid()}\\n")
        time.sleep(0.5)  # long enough for every other process to reach the lock
        out = Path(build_directory) / f"{name}.so"
        out.write_bytes(b"\\x7fELF fake library " * 4096)
        return str(out)


    # Only jit's locking is under test: a stub tvm_ffi (the real one imports torch, ~1.5 s a process),
    # and jit.py loaded on its own (it imports nothing from the package) rather than via flux2_fused.ops.
    tvm_ffi, cpp = types.ModuleType("tvm_ffi"), types.ModuleType("tvm_ffi.cpp")
    tvm_ffi.__version__, tvm_ffi.cpp, cpp.build = "stub", cpp, slow_fake_build
    sys.modules.update({"tvm_ffi": tvm_ffi, "tvm_ffi.cpp": cpp})
    spec = importlib.util.spec_from_file_location("jit", sys.argv[5])
    jit = sys.modules["jit"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(jit)
    jit.find_nvcc = lambda: "/opt/fake-cuda/bin/nvcc"
    jit._nvcc_version = lambda nvcc: "fake nvcc 0.0"

    (barrier / str(os.getpid())).touch()
    deadline = time.monotonic() + 30
    while len(list(barrier.iterdir())) < count:  # start building together
        if time.monotonic() > deadline:
            sys.exit("barrier timed out")
        time.sleep(0.002)
    spec = jit.KernelSpec("gated_resnorm", ("gated_resnorm.cu",), ("gated_resnorm.cuh",))
    print(jit.build(spec, ["9.0"], cache_dir=cache))
    """
)


def test_four_processes_build_once(tmp_path: Path) -> None:
    count, log, barrier = 4, tmp_path / "builds.log", tmp_path / "barrier"
    barrier.mkdir()
    args = [
        sys.executable,
        "-c",
        CHILD,
        str(tmp_path / "cache"),
        str(log),
        str(barrier),
        str(count),
        jit.__file__,
    ]
    children = [
        subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(count)
    ]
    results = [child.communicate(timeout=120) for child in children]
    assert all(child.returncode == 0 for child in children), [err for _, err in results]
    paths = {out.strip() for out, _ in results}
    assert len(paths) == 1, paths
    lib = Path(paths.pop())
    assert len(log.read_text().splitlines()) == 1  # exactly one compile
    assert digest_matches(lib) and lib.read_bytes() == b"\x7fELF fake library " * 4096
    assert leftovers(lib.parent) == []


# --------------------------------------------------------------------------- corrupt cache


@pytest.mark.parametrize("damage", ["truncated", "one byte flipped", "digest missing", "digest empty"])
def test_corrupt_library_is_detected_and_rebuilt(
    fake_compiler: FakeCompiler, tmp_path: Path, damage: str
) -> None:
    lib = jit.build(SPEC, ["9.0"], cache_dir=tmp_path)
    data = lib.read_bytes()
    digest = lib.with_suffix(".sha256")
    if damage == "truncated":
        lib.write_bytes(data[: len(data) // 2])
    elif damage == "one byte flipped":
        lib.write_bytes(data[:10] + bytes([data[10] ^ 0xFF]) + data[11:])
    elif damage == "digest missing":
        digest.unlink()
    else:
        digest.write_text("")
    assert jit.build(SPEC, ["9.0"], cache_dir=tmp_path) == lib
    assert len(fake_compiler.calls) == 2
    assert digest_matches(lib) and b"build 2" in lib.read_bytes()


def test_leftovers_of_a_killed_build_are_cleaned(fake_compiler: FakeCompiler, tmp_path: Path) -> None:
    target = jit.build(SPEC, ["9.0"], cache_dir=tmp_path).parent
    (target / SPEC.library).unlink()
    (target / f".{SPEC.library}.12345").write_bytes(b"\x7fELF half")  # staged copy of a killed process
    (target / "build-abc123").mkdir()  # its compiler folder
    (target / "build-abc123" / "gated_resnorm.cuda.o").write_bytes(b"")
    jit.build(SPEC, ["9.0"], cache_dir=tmp_path)
    assert leftovers(target) == []


# --------------------------------------------------------------------------- loading


@pytest.mark.usefixtures("fresh_load_module")
def test_load_failure_deletes_and_rebuilds_once(
    fake_compiler: FakeCompiler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library whose digest matches but which does not load is rebuilt, then loaded."""
    monkeypatch.setenv(jit.CACHE_ENV, str(tmp_path))
    loaded: list[str] = []
    module = object()

    def load(path: str) -> object:
        loaded.append(Path(path).read_text(errors="replace"))
        if len(loaded) == 1:
            raise RuntimeError("invalid ELF header")
        return module

    monkeypatch.setattr(tvm_ffi, "load_module", load)
    assert jit.load_module(SPEC, "9.0") is module
    assert len(fake_compiler.calls) == 2
    assert "build 1" in loaded[0] and "build 2" in loaded[1]  # the second load read the new library
    assert jit.load_module(SPEC, "9.0") is module and len(loaded) == 2  # memoized


@pytest.mark.usefixtures("fresh_load_module")
def test_load_failing_twice_is_a_build_error(
    fake_compiler: FakeCompiler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(jit.CACHE_ENV, str(tmp_path))
    messages = iter(["invalid ELF header", "libcudart.so.13: cannot open shared object file"])

    def load(path: str) -> object:
        raise RuntimeError(next(messages))

    monkeypatch.setattr(tvm_ffi, "load_module", load)
    with pytest.raises(jit.BuildError, match=r"also after a rebuild: libcudart\.so\.13") as info:
        jit.load_module(SPEC, "9.0")
    assert "invalid ELF header" in str(info.value)
    assert len(fake_compiler.calls) == 2


# --------------------------------------------------------------------------- tvm-ffi missing

WITHOUT_TVM_FFI = textwrap.dedent(
    """
    import sys

    sys.modules["tvm_ffi"] = None  # every `import tvm_ffi...` now raises ImportError
    import flux2_fused
    import flux2_fused.models.flux2
    import flux2_fused.ops
    import torch
    from flux2_fused.ops import jit
    from flux2_fused.ops.gated_resnorm import guards
    from flux2_fused.ops.gated_resnorm.launch import SPEC

    assert guards.gated(*(torch.zeros(1, 2, 8, dtype=torch.bfloat16),) * 5) is False
    for attempt in (lambda: jit.build(SPEC, ["9.0"]), lambda: jit.load_module(SPEC, "9.0")):
        try:
            attempt()
        except jit.BuildError as exc:
            print(exc)
    """
)


def test_package_imports_without_tvm_ffi() -> None:
    path = [str(PACKAGE_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    run = subprocess.run(
        [sys.executable, "-c", WITHOUT_TVM_FFI], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("apache-tvm-ffi is not installed") for line in lines), (
        lines
    )
