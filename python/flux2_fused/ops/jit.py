"""Just-in-time build of the CUDA kernels through apache-tvm-ffi, with a content-addressed disk cache.

Why JIT: the kernel is compiled for exactly the GPU present, needs neither torch headers nor a GPU
to build (CI compiles it on a CPU machine), and one wheel serves every architecture. The cache key
covers everything that changes the machine code: the sources' bytes, the compiler flags, the target
architectures and the nvcc and tvm-ffi versions. Builds happen under an inter-process file lock in a
private folder and are published with an atomic rename next to a SHA-256 of the library, so four
processes starting at once build once, and a truncated or corrupt library is detected and rebuilt.
"""

from __future__ import annotations

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

_build_lock = threading.Lock()


class BuildError(RuntimeError):
    """The kernel could not be built or loaded; the message names the cause."""


def cache_root() -> Path:
    """The cache folder: $FLUX2_FUSED_CACHE_DIR, else ~/.cache/flux2-fused."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "flux2-fused"


def find_cuda_home() -> Path | None:
    """The CUDA toolkit: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, else the one holding nvcc on PATH."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return Path(home)
    found = shutil.which("nvcc")
    return Path(found).resolve().parent.parent if found else None


def find_nvcc() -> str | None:
    home = find_cuda_home()
    return str(home / "bin" / "nvcc") if home is not None else None


@functools.cache
def _nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout else "unknown"


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


def _is_valid(lib: Path) -> bool:
    digest = lib.with_suffix(".sha256")
    return lib.is_file() and digest.is_file() and digest.read_text().strip() == _sha256(lib)


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
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".probe-"):
            return root
    except OSError as exc:
        private = Path(tempfile.mkdtemp(prefix="flux2-fused-cache-"))
        warnings.warn(
            f"flux2-fused: kernel cache {root} is not writable ({exc}); building in {private} instead",
            RuntimeWarning,
            stacklevel=3,
        )
        return private


def build(archs: Sequence[str], cache_dir: Path | None = None) -> Path:
    """Compile the kernels for `archs` (e.g. ['9.0', '10.0']) unless cached; return the library path.

    Needs nvcc but no GPU. Raises BuildError naming the cause on any failure.
    """
    archs = sorted({normalize_arch(a) for a in archs})
    if not archs:
        raise BuildError("no CUDA architecture given")
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (put the CUDA toolkit's bin on PATH or set CUDA_HOME)")
    try:
        import tvm_ffi.cpp
    except ImportError as exc:
        raise BuildError(f"apache-tvm-ffi is not installed ({exc})") from exc

    root = _writable_cache(cache_dir if cache_dir is not None else cache_root())
    target = root / cache_key(archs, nvcc)
    lib = target / LIBRARY
    with _build_lock:
        if _is_valid(lib):
            return lib
        target.mkdir(parents=True, exist_ok=True)
        with _file_lock(target / ".lock"):
            if _is_valid(lib):  # another process finished the build while we waited
                return lib
            work = Path(tempfile.mkdtemp(prefix="build-", dir=target))
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
                staged = target / f".{LIBRARY}.{os.getpid()}"
                shutil.copyfile(built, staged)
                lib.with_suffix(".sha256").write_text(_sha256(staged))
                os.replace(staged, lib)
            except Exception as exc:
                raise BuildError(f"building the flux2-fused kernels failed: {exc}") from exc
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return lib


def device_arch(device: Any) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


@functools.cache
def load_module(arch: str) -> Any:
    """Build (or find in the cache) and load the kernels for one architecture; memoized."""
    import tvm_ffi

    lib = build([arch])
    try:
        return tvm_ffi.load_module(str(lib))
    except Exception as exc:
        raise BuildError(f"loading {lib} failed: {exc}") from exc
