"""The prebuilt kernels of a wheel: which GPUs a bundled module covers, when `jit` takes it (and when
not), and the wheel itself, built once with the real toolchain (CI has nvcc): what each module links,
the glibc and libstdc++ versions it needs, the architectures it carries, and that an installed wheel
with the CUDA toolkit hidden loads every op's bundled module and attempts no build."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from flux2_fused.ops import OPS, bundle, jit

from .fatbin import fatbin_targets

REPO = Path(__file__).resolve().parents[2]
SPEC = OPS[0].spec
WHEEL_ARCHS = {f"sm_{a.replace('.', '')}" for a in bundle.ARCHS} | {"ptx_120"}


@pytest.mark.parametrize(
    ("arch", "covered"),
    [
        ("8.0", True),
        ("8.7", True),
        ("9.0", True),
        ("10.3", True),
        ("12.1", True),
        ("13.0", True),
        ("11.0", False),
    ],
)
def test_a_bundle_covers_same_major_newer_minor_and_ptx_newer(arch: str, covered: bool) -> None:
    assert bundle_covers_wheel(arch) is covered


def bundle_covers_wheel(arch: str) -> bool:
    return jit.bundle_covers(bundle.ARCHS, bundle.PTX, arch)


def test_no_ptx_means_no_newer_major() -> None:
    assert not jit.bundle_covers(["9.0"], None, "10.0") and not jit.bundle_covers(["9.0"], None, "8.9")


def _fake_bundle(folder: Path, **entry: object) -> Path:
    jit._bundle_manifest.cache_clear()
    folder.mkdir(exist_ok=True)
    (folder / SPEC.library).write_bytes(b"module")
    module = {"library": SPEC.library, "sources": jit.source_digest(SPEC), "archs": ["9.0"], "ptx": None}
    manifest = {"modules": {SPEC.name: {**module, **entry}}}
    (folder / jit.BUNDLE_MANIFEST).write_text(json.dumps(manifest))
    return folder


def test_a_bundled_module_is_taken_only_from_the_same_sources_for_a_covered_gpu(tmp_path: Path) -> None:
    good = _fake_bundle(tmp_path / "good")
    assert jit.bundled_library(SPEC, "9.0", good) == good / SPEC.library
    assert jit.bundled_library(SPEC, "10.0", good) is None  # no machine code, no PTX for it
    stale = _fake_bundle(tmp_path / "stale", sources="0" * 64)  # built from other sources
    assert jit.bundled_library(SPEC, "9.0", stale) is None
    broken = _fake_bundle(tmp_path / "broken", archs="not a list")
    assert jit.bundled_library(SPEC, "9.0", broken) is None
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / jit.BUNDLE_MANIFEST).write_text("{not json")
    jit._bundle_manifest.cache_clear()
    assert jit.bundled_library(SPEC, "9.0", tmp_path / "garbage") is None
    assert jit.bundled_library(SPEC, "9.0", tmp_path / "missing") is None


@pytest.fixture
def fresh_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """No module loaded yet in this test, whatever earlier tests loaded."""
    monkeypatch.setattr(jit, "_loaded", {})
    monkeypatch.setattr(jit, "_origins", {})


def test_load_module_prefers_the_bundle_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_modules: None
) -> None:
    monkeypatch.setattr(jit, "BUNDLE_DIR", _fake_bundle(tmp_path / "b"))
    monkeypatch.setattr(jit, "_load", lambda lib: ("loaded", lib.name))
    monkeypatch.setattr(
        jit, "_jit_load", lambda spec, arch: pytest.fail("no build when the bundle covers the GPU")
    )
    assert jit.load_module(SPEC, "9.0") == ("loaded", SPEC.library)
    assert jit.module_origin(SPEC, "9.0") == f"bundled ({SPEC.library})"


def test_a_bundled_module_that_does_not_load_warns_and_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_modules: None
) -> None:
    monkeypatch.setattr(jit, "BUNDLE_DIR", _fake_bundle(tmp_path / "b"))

    def load(lib: Path) -> object:
        raise OSError("bad ELF")

    monkeypatch.setattr(jit, "_load", load)
    monkeypatch.setattr(jit, "_jit_load", lambda spec, arch: "built")
    monkeypatch.setattr(jit, "is_cached", lambda spec, archs: False)
    with pytest.warns(RuntimeWarning, match="bundled .* did not load .*bad ELF.*building it instead"):
        assert jit.load_module(SPEC, "9.0") == "built"
    assert jit.module_origin(SPEC, "9.0") == "built now"


def test_without_bundle_or_toolkit_the_origin_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_modules: None
) -> None:
    monkeypatch.setattr(jit, "BUNDLE_DIR", tmp_path / "none")
    monkeypatch.setattr(jit, "find_nvcc", lambda: None)
    with pytest.raises(jit.BuildError, match="nvcc not found"):
        jit.load_module(SPEC, "9.0")
    assert jit.module_origin(SPEC, "9.0").startswith("unavailable: nvcc not found")


def test_gencode_flags() -> None:
    assert bundle.gencode_flags(["9.0", "10.0"], "10.0") == [
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_100,code=sm_100",
        "-gencode=arch=compute_100,code=compute_100",
    ]


# --------------------------------------------------------------------------- the wheel, built for real


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`FLUX2_FUSED_BUNDLE_KERNELS=1 pip wheel .` of this checkout (about two minutes on two cores)."""
    if jit.toolchain_reason() is not None:
        pytest.skip(f"no toolchain to bundle the kernels: {jit.toolchain_reason()}")
    if bundle.find_zig() is None:
        pytest.skip("no zig to link the bundled kernels (pip install ziglang; the test extra has it)")
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "FLUX2_FUSED_BUNDLE_KERNELS": "1"}
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(out),
    ]
    done = subprocess.run([*command, str(REPO)], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def modules(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("modules")
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.startswith("flux2_fused/ops/prebuilt/")]
        archive.extractall(folder, names)
    return {path.name: path for path in (folder / "flux2_fused/ops/prebuilt").iterdir()}


def test_the_wheel_is_a_platform_wheel_under_27_mb(wheel: Path, modules: dict[str, Path]) -> None:
    """Six ops for six architectures and a PTX: 24.4 MB before the norms' quantizing forms, whose
    kernels (24 of gated_resnorm's, each about 140 KB, and 2 of sandwich_norm's) take it near the
    cap; an instantiation no model launches is not worth its share."""
    assert wheel.name.endswith(f"-py3-none-{bundle.PLATFORM}.whl")
    assert wheel.stat().st_size <= 27 * 2**20
    manifest = json.loads(modules[jit.BUNDLE_MANIFEST].read_text())
    assert set(manifest["modules"]) == {op.name for op in OPS}
    for op in OPS:
        entry = manifest["modules"][op.name]
        assert entry["sources"] == jit.source_digest(op.spec) and op.spec.library in modules


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} (binutils) is not installed")
    return path


def _versions(text: str, prefix: str) -> list[tuple[int, ...]]:
    return [tuple(map(int, v.split("."))) for v in re.findall(rf"\b{prefix}_([0-9.]+[0-9])\b", text)]


# What manylinux_2_28 (auditwheel's policy) lets a module need: these libraries (and libtvm_ffi, which
# tvm-ffi loads before any module), and symbol versions up to these.
MANYLINUX_2_28_LIBRARIES = {
    "libc.so.6",
    "libdl.so.2",
    "libgcc_s.so.1",
    "libm.so.6",
    "libpthread.so.0",
    "librt.so.1",
    "libstdc++.so.6",
    "ld-linux-x86-64.so.2",
}
MANYLINUX_2_28_VERSIONS = {"GLIBC": (2, 28), "GLIBCXX": (3, 4, 24), "CXXABI": (1, 3, 11), "GCC": (7, 0, 0)}


@pytest.mark.parametrize("op", [op.name for op in OPS])
def test_each_module_is_self_contained(op: str, modules: dict[str, Path]) -> None:
    """No CUDA runtime or torch to link against (the runtime is static), libraries and symbol versions
    within manylinux_2_28, nothing exported but its tvm-ffi functions, machine code for every wheel
    architecture and compute_120 PTX."""
    library = modules[f"flux2_fused_{op}.so"]
    needed = subprocess.run([_tool("readelf"), "-d", str(library)], capture_output=True, text=True).stdout
    libraries = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", needed))
    assert libraries <= MANYLINUX_2_28_LIBRARIES | {"libtvm_ffi.so"}
    symbols = subprocess.run([_tool("objdump"), "-T", str(library)], capture_output=True, text=True).stdout
    for prefix, newest in MANYLINUX_2_28_VERSIONS.items():
        too_new = [line for line in symbols.splitlines() if max(_versions(line, prefix), default=()) > newest]
        assert not too_new, f"{prefix} newer than manylinux_2_28 allows: {too_new}"
    exported = subprocess.run(
        [_tool("nm"), "-D", "--defined-only", str(library)], capture_output=True, text=True
    ).stdout.split()[2::3]
    assert f"__tvm_ffi_{op}" in exported and all(name.startswith("__tvm_ffi_") for name in exported)
    assert fatbin_targets(library) == WHEEL_ARCHS


def test_the_installed_wheel_loads_its_modules_without_a_toolkit(wheel: Path, tmp_path: Path) -> None:
    """pip-installed into a fresh folder, run with no CUDA toolkit in reach (no CUDA_HOME or CUDA_PATH,
    no folder on PATH that holds an nvcc, neither /usr/local/cuda nor NVIDIA's pip packages
    consulted): every op loads its bundled module on Hopper, Blackwell and a newer GPU (through
    PTX); no build is ever attempted; a GPU the bundle does not cover says why."""
    target = tmp_path / "site"
    install = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-index",
        "--target",
        str(target),
    ]
    subprocess.run([*install, str(wheel)], check=True, capture_output=True)
    script = """
import sys
from flux2_fused.ops import OPS, jit
jit.DEFAULT_CUDA_HOMES = ()
jit.pip_cuda_homes = list
attempts, build = [], jit.build
def counting_build(spec, *args, **kwargs):
    attempts.append(spec.name)
    return build(spec, *args, **kwargs)
jit.build = counting_build
assert jit.toolchain_reason() is not None, "the toolkit is visible"
assert jit.__file__.startswith(sys.argv[1]), jit.__file__
for arch in ("9.0", "10.0", "13.0"):
    for op in OPS:
        jit.load_module(op.spec, arch)
        assert jit.module_origin(op.spec, arch).startswith("bundled"), (op.name, arch)
assert not attempts, attempts
try:
    jit.load_module(OPS[0].spec, "11.0")
except jit.BuildError as exc:
    print("11.0:", exc)
print("ok")
"""
    folders = os.environ.get("PATH", "").split(os.pathsep)
    path = os.pathsep.join(p for p in folders if p and not (Path(p) / "nvcc").exists())  # no nvcc in reach
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env.update(PATH=path, PYTHONPATH=str(target), FLUX2_FUSED_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run(
        [sys.executable, "-c", script, str(target)], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "11.0: nvcc not found" in done.stdout and done.stdout.strip().endswith("ok")
