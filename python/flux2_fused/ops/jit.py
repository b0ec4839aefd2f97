"""Just-in-time build of the CUDA kernels through apache-tvm-ffi, with a content-addressed disk cache.

Why JIT: the kernel is compiled for exactly the GPU present, needs neither torch headers nor a GPU
to build (CI compiles it on a CPU machine), and one wheel serves every architecture. The cache key
covers everything that changes the machine code: the sources' bytes, the compiler flags, the target
architectures and the nvcc and tvm-ffi versions.

Why so defensive: a kernel that cannot be built must cost the user one warning and eager speed,
never a failed generation. Every failure surfaces as a BuildError naming its cause (nvcc or tvm-ffi
missing, compiler errors, an unusable cache). Builds happen under an inter-process file lock in a
private folder and are published with an atomic rename next to a SHA-256 of the library, so four
processes starting at once build once, a build killed half-way leaves nothing that looks finished,
and a truncated or corrupt library is detected and rebuilt. An unwritable cache folder degrades to
a private temporary one, with a warning.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("gated_resnorm.cu", "gated_resnorm.cuh")
MODULE_NAME = "flux2_fused_ops"
# No --use_fast_math: the kernel's bit-exactness rests on IEEE division and no flush-to-zero.
CUDA_FLAGS = ("-std=c++17", "-lineinfo")
CACHE_ENV = "FLUX2_FUSED_CACHE_DIR"
LIBRARY = f"{MODULE_NAME}.so"
# Where a toolkit usually lives when neither $CUDA_HOME nor $CUDA_PATH says; searched before PATH.
DEFAULT_CUDA_HOMES = ("/usr/local/cuda",)

# Serializes builds within the process (the file lock serializes them across processes) and guards
# the fallback folders below.
_build_lock = threading.Lock()
_fallback_dirs: dict[Path, Path] = {}


class BuildError(RuntimeError):
    """The kernel could not be built or loaded; the message names the cause."""


def cache_root() -> Path:
    """The cache folder: $FLUX2_FUSED_CACHE_DIR, else ~/.cache/flux2-fused."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "flux2-fused"


def find_cuda_home() -> Path | None:
    """The CUDA toolkit: $CUDA_HOME, $CUDA_PATH, DEFAULT_CUDA_HOMES, else the one holding nvcc on PATH."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), *DEFAULT_CUDA_HOMES):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return Path(home)
    found = shutil.which("nvcc")
    return Path(found).resolve().parent.parent if found else None


def find_nvcc() -> str | None:
    """The nvcc that builds the kernels, or None when no CUDA toolkit is found."""
    home = find_cuda_home()
    return str(home / "bin" / "nvcc") if home is not None else None


@functools.cache
def _nvcc_version(nvcc: str) -> str:
    """nvcc's version line, for the cache key; 'unknown' if nvcc cannot run (the build then says why)."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False)
    except OSError:
        return "unknown"
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else "unknown"


def normalize_arch(arch: str) -> str:
    """'9.0', '90', 'sm_90' and '9.0a' all name one target; returns the 'M.m[a]' form tvm-ffi takes."""
    text = arch.strip().lower().removeprefix("sm_").removeprefix("compute_")
    suffix = "a" if text.endswith("a") else ""
    text = text.removesuffix("a")
    if "." not in text:
        if not text.isdigit() or len(text) < 2:
            raise ValueError(f"unrecognized CUDA architecture {arch!r} (expected e.g. 9.0, 10.0, sm_90)")
        text = f"{text[:-1]}.{text[-1]}"
    major, minor = text.split(".", 1)
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(f"unrecognized CUDA architecture {arch!r} (expected e.g. 9.0, 10.0, sm_90)")
    return f"{int(major)}.{int(minor)}{suffix}"


def cache_key(archs: Sequence[str], nvcc: str) -> str:
    """The cache folder name: a digest of everything that changes the compiled library."""
    import tvm_ffi

    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    for part in (*CUDA_FLAGS, "|", *archs, "|", _nvcc_version(nvcc), "|", tvm_ffi.__version__):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digest_path(lib: Path) -> Path:
    return lib.with_suffix(".sha256")


def _is_valid(lib: Path) -> bool:
    """True when `lib` and its digest sidecar exist and agree (a half-written or damaged file never does)."""
    digest = _digest_path(lib)
    try:
        return lib.is_file() and digest.is_file() and digest.read_text().strip() == _sha256(lib)
    except OSError:
        return False


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _build_env(archs: Sequence[str], nvcc: str) -> Iterator[None]:
    """tvm-ffi reads the target list and finds nvcc/ninja through the environment."""
    saved = {k: os.environ.get(k) for k in ("TVM_FFI_CUDA_ARCH_LIST", "CUDA_HOME", "PATH")}
    os.environ["TVM_FFI_CUDA_ARCH_LIST"] = " ".join(archs)
    os.environ["CUDA_HOME"] = str(Path(nvcc).parent.parent)
    extra_path = [str(Path(nvcc).parent)]
    with contextlib.suppress(ImportError):
        import ninja

        extra_path.append(str(ninja.BIN_DIR))
    os.environ["PATH"] = os.pathsep.join([*extra_path, os.environ.get("PATH", "")])
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _writable_cache(root: Path) -> Path:
    """`root`, created if needed; if it cannot be written, a private temporary folder instead.

    The fallback is made once per root and process (one warning, one build per key) and removed
    at exit. It is private (mkdtemp) rather than a fixed shared path because a library loaded
    from a folder others can write to would run their code.
    """
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".probe-"):
            return root
    except OSError as exc:
        with _build_lock:
            private = _fallback_dirs.get(root)
            if private is None:
                private = _fallback_dirs[root] = Path(tempfile.mkdtemp(prefix="flux2-fused-cache-"))
                atexit.register(shutil.rmtree, private, ignore_errors=True)
                warnings.warn(
                    f"flux2-fused: kernel cache {root} is not writable ({exc}); "
                    f"building in {private} instead",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return private


def _remove_library(lib: Path) -> None:
    """Delete `lib`, its digest and what a build killed half-way left beside them (caller holds the lock)."""
    lib.unlink(missing_ok=True)
    _digest_path(lib).unlink(missing_ok=True)
    for staged in lib.parent.glob(f".{lib.name}.*"):
        staged.unlink(missing_ok=True)
    for work in lib.parent.glob("build-*"):
        shutil.rmtree(work, ignore_errors=True)


def _compile(archs: Sequence[str], nvcc: str, lib: Path) -> None:
    """Compile in a private folder and publish `lib` with its digest; the caller holds the file lock.

    The library is copied to a hidden name and renamed into place only once its digest is written,
    so no reader (they all check the digest) ever takes a partial file for a finished one.
    """
    import tvm_ffi.cpp

    target = lib.parent
    _remove_library(lib)  # an invalid library must not survive a failed rebuild
    work = Path(tempfile.mkdtemp(prefix="build-", dir=target))
    staged = target / f".{lib.name}.{os.getpid()}"
    try:
        with _build_env(archs, nvcc):
            built = tvm_ffi.cpp.build(
                MODULE_NAME,
                cuda_files=[str(CSRC / "gated_resnorm.cu")],
                extra_cuda_cflags=list(CUDA_FLAGS),
                extra_include_paths=[str(CSRC)],
                # Some toolkits keep libcudart under lib/ rather than the lib64/ tvm-ffi uses.
                extra_ldflags=[f"-L{Path(nvcc).parent.parent / 'lib'}"],
                build_directory=str(work),
                backend="cuda",
            )
        shutil.copyfile(built, staged)
        _digest_path(lib).write_text(_sha256(staged))
        os.replace(staged, lib)
    finally:
        staged.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)


def build(archs: Sequence[str], cache_dir: Path | None = None) -> Path:
    """Compile the kernels for `archs` (e.g. ['9.0', '10.0']) unless cached; return the library path.

    Needs nvcc but no GPU. Raises ValueError for an unrecognized architecture and BuildError naming
    the cause for anything that stops the build.
    """
    archs = sorted({normalize_arch(a) for a in archs})
    if not archs:
        raise BuildError("no CUDA architecture given")
    # Checked first: without tvm-ffi nothing can be built or loaded, whatever else is installed.
    try:
        import tvm_ffi.cpp  # noqa: F401
    except ImportError as exc:
        raise BuildError(f"apache-tvm-ffi is not installed or not importable ({exc})") from exc
    nvcc = find_nvcc()
    if nvcc is None:
        searched = ", ".join(["$CUDA_HOME", "$CUDA_PATH", *DEFAULT_CUDA_HOMES])
        raise BuildError(
            f"nvcc not found: no CUDA toolkit in {searched} or on PATH (install one or set CUDA_HOME)"
        )
    try:
        key = cache_key(archs, nvcc)
    except OSError as exc:
        raise BuildError(f"cannot read the kernel sources in {CSRC} ({exc})") from exc
    try:
        lib = _writable_cache(cache_dir if cache_dir is not None else cache_root()) / key / LIBRARY
    except OSError as exc:
        raise BuildError(f"no folder to build the kernels in ({exc})") from exc
    with _build_lock:
        if _is_valid(lib):
            return lib
        try:
            lib.parent.mkdir(parents=True, exist_ok=True)
            with _file_lock(lib.parent / ".lock"):
                if not _is_valid(lib):  # another process may have finished the build while we waited
                    _compile(archs, nvcc, lib)
        except Exception as exc:
            raise BuildError(f"building the flux2-fused kernels in {lib.parent} failed: {exc}") from exc
    return lib


def device_arch(device: Any) -> str:
    """The 'M.m' compute capability of a CUDA device."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


def _load(lib: Path) -> Any:
    import tvm_ffi

    return tvm_ffi.load_module(str(lib))


@functools.cache
def load_module(arch: str) -> Any:
    """Build (or find in the cache) and load the kernels for one architecture; memoized.

    A library whose bytes match its digest can still fail to load (say, built by a toolchain whose
    runtime is gone, or damaged together with its digest), and rebuilding it is cheaper than running
    eager for the rest of the process: so it is deleted and rebuilt once before BuildError is raised.
    """
    lib = build([arch])
    try:
        return _load(lib)
    except Exception as first:
        with _build_lock, _file_lock(lib.parent / ".lock"):
            _remove_library(lib)
        lib = build([arch])
        try:
            return _load(lib)
        except Exception as exc:
            raise BuildError(f"loading {lib} failed, also after a rebuild: {exc} (first: {first})") from exc
