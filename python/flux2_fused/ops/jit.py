"""Just-in-time build of the CUDA kernels through apache-tvm-ffi, with a content-addressed disk cache.

Each op declares its sources as a `KernelSpec` (its own package's `launch.py`), the way flashinfer's
`gen_*_module` functions do; this module builds and loads any spec and keeps the one cache of loaded
modules, so no op holds kernel-loading state of its own.

Where a module comes from, per op and architecture, in this order: the module bundled in a wheel
(`prebuilt/`, made by `bundle.py` for the common architectures; used when its manifest says it was
built from these exact sources and covers the GPU), the user's cache, a JIT build with the local
CUDA toolkit, else BuildError (and the ops run eager with one warning). `module_origin` says which.
JIT needs neither torch headers nor a GPU to build (CI compiles every kernel on a CPU machine). The
cache key covers everything that changes the machine code: the sources' bytes, the compiler flags,
the target architectures and the nvcc and tvm-ffi versions.

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
import importlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CSRC = Path(__file__).resolve().parent / "csrc"
# No --use_fast_math: the kernel's bit-exactness rests on IEEE division and no flush-to-zero.
CUDA_FLAGS = ("-std=c++17", "-lineinfo")
CACHE_ENV = "FLUX2_FUSED_CACHE_DIR"
# Where a toolkit usually lives when neither $CUDA_HOME nor $CUDA_PATH says; searched before PATH.
DEFAULT_CUDA_HOMES = ("/usr/local/cuda",)
# The kernels use sm_80 instructions (packed bf16 pair math): compute capability 8.0 or newer.
MIN_CAPABILITY = (8, 0)
# Modules bundled in a wheel: one library per op and its manifest (`bundle.py` writes both).
BUNDLE_DIR = Path(__file__).resolve().parent / "prebuilt"
BUNDLE_MANIFEST = "manifest.json"

# Serializes builds within the process (the file lock serializes them across processes) and guards
# the fallback folders below.
_build_lock = threading.Lock()
_fallback_dirs: dict[Path, Path] = {}


class BuildError(RuntimeError):
    """The kernel could not be built or loaded; the message names the cause."""


@dataclass(frozen=True)
class KernelSpec:
    """One op's CUDA module: the `.cu` files compiled into it and the headers they include (both in
    csrc/, both part of the cache key). `name` names the module, its library file and its cache folder."""

    name: str
    sources: tuple[str, ...]
    headers: tuple[str, ...] = ()

    @property
    def module_name(self) -> str:
        return f"flux2_fused_{self.name}"

    @property
    def library(self) -> str:
        return f"{self.module_name}.so"


def cache_root() -> Path:
    """The cache folder: $FLUX2_FUSED_CACHE_DIR, else ~/.cache/flux2-fused."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "flux2-fused"


# Where NVIDIA's pip packages put a toolkit inside their `nvidia` namespace package (the `[jit]`
# extra: CUDA 13's nvidia-cuda-nvcc with its headers, runtime and NVVM, all under one folder). CUDA
# 12's packages hold no compiler to find: nvidia-cuda-nvcc-cu12 (12.9) ships ptxas, libnvvm and
# libdevice, without the nvcc driver, cicc or cudafe++ that compile a .cu file.
PIP_CUDA_HOMES = ("cu13",)


def pip_cuda_homes() -> list[Path]:
    """Toolkit folders of NVIDIA's pip packages, wherever the `nvidia` namespace package is installed."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    return [Path(root) / name for root in roots for name in PIP_CUDA_HOMES]


def find_cuda_home() -> Path | None:
    """The CUDA toolkit: $CUDA_HOME, $CUDA_PATH, DEFAULT_CUDA_HOMES, the one holding nvcc on PATH,
    else the one NVIDIA's pip packages installed (`pip install flux2-fused[jit]`)."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), *DEFAULT_CUDA_HOMES):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return Path(home)
    found = shutil.which("nvcc")
    if found:
        return Path(found).resolve().parent.parent
    return next((home for home in pip_cuda_homes() if (home / "bin" / "nvcc").is_file()), None)


def cudart_link_dirs(home: Path, scratch: Path) -> list[Path]:
    """Folders for the linker's `-lcudart` (which tvm-ffi always passes): the toolkit's lib64 and lib,
    and where a toolkit has only the versioned `libcudart.so.N` (NVIDIA's pip packages), a folder in
    `scratch` with a `libcudart.so` link to it (the module then needs `libcudart.so.N`, the library
    torch has loaded)."""
    dirs = [home / "lib64", home / "lib"]
    if any((folder / "libcudart.so").exists() for folder in dirs):
        return dirs
    versioned = sorted(p for folder in dirs if folder.is_dir() for p in folder.glob("libcudart.so.[0-9]*"))
    if not versioned:
        return dirs
    link = scratch / "cudart"
    link.mkdir(parents=True, exist_ok=True)
    (link / "libcudart.so").unlink(missing_ok=True)
    (link / "libcudart.so").symlink_to(versioned[0])
    return [*dirs, link]


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


def cache_key(spec: KernelSpec, archs: Sequence[str], nvcc: str) -> str:
    """The cache folder name: the module's name and a digest of everything that changes its library."""
    import tvm_ffi

    h = hashlib.sha256(source_digest(spec).encode())
    for part in ("|", *archs, "|", _nvcc_version(nvcc), "|", tvm_ffi.__version__):
        h.update(part.encode())
        h.update(b"\0")
    return f"{spec.name}-{h.hexdigest()[:24]}"


def source_digest(spec: KernelSpec) -> str:
    """A digest of what a module is built from that does not depend on the machine: the sources' and
    headers' names and bytes and the compiler flags. A bundled module is used only under the same one."""
    h = hashlib.sha256()
    for name in (*spec.sources, *spec.headers):
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    for flag in CUDA_FLAGS:
        h.update(flag.encode())
        h.update(b"\0")
    return h.hexdigest()


def arch_tuple(arch: str) -> tuple[int, int]:
    """(major, minor) of an architecture, for ordering them."""
    major, minor = normalize_arch(arch).removesuffix("a").split(".")
    return int(major), int(minor)


def bundle_covers(archs: Sequence[str], ptx: str | None, arch: str) -> bool:
    """Whether a module with machine code for `archs` and PTX for `ptx` runs on `arch`: machine code of
    the same major version and no newer minor one (CUDA's binary compatibility), or PTX for an
    architecture no newer than it (the driver compiles it)."""
    major, minor = arch_tuple(arch)
    if any(m == major and n <= minor for m, n in map(arch_tuple, archs)):
        return True
    return ptx is not None and arch_tuple(ptx) <= (major, minor)


@functools.cache
def _bundle_manifest(folder: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((folder / BUNDLE_MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def bundled_library(spec: KernelSpec, arch: str, folder: Path | None = None) -> Path | None:
    """The bundled library of `spec` that runs on `arch`, None where there is none: no bundle, a
    module built from other sources (an editable install whose sources changed since), or one that
    does not cover the architecture."""
    folder = folder or BUNDLE_DIR
    entry = _bundle_manifest(folder).get("modules", {}).get(spec.name)
    if not isinstance(entry, dict):
        return None
    try:
        if entry.get("sources") != source_digest(spec):
            return None
        lib = folder / str(entry["library"])
        covered = bundle_covers(entry["archs"], entry.get("ptx"), arch)
    except (OSError, KeyError, TypeError, ValueError):
        return None
    return lib if covered and lib.is_file() else None


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


def _owned_private_folder(path: Path) -> bool:
    """True when `path` is a real folder that only this user owns and can write (0o700 or stricter)."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def fallback_cache_dir() -> Path:
    """The folder builds go to when the configured cache cannot be written: one per user, reused
    by every run (so an unusable $FLUX2_FUSED_CACHE_DIR costs one build, not one a run).

    It must be private: a library loaded from a folder others can write to would run their code.
    When the per-user folder exists but is not this user's private folder, a fresh private one is
    made for this process and removed at exit.
    """
    shared = Path(tempfile.gettempdir()) / f"flux2-fused-cache-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        shared.mkdir(mode=0o700)
    if _owned_private_folder(shared):
        return shared
    private = Path(tempfile.mkdtemp(prefix="flux2-fused-cache-"))
    atexit.register(shutil.rmtree, private, ignore_errors=True)
    return private


def _writable_cache(root: Path) -> Path:
    """`root`, created if needed; if it cannot be written, `fallback_cache_dir()` with one warning
    per root and process."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".probe-"):
            return root
    except OSError as exc:
        with _build_lock:
            fallback = _fallback_dirs.get(root)
            if fallback is None:
                fallback = _fallback_dirs[root] = fallback_cache_dir()
                warnings.warn(
                    f"flux2-fused: kernel cache {root} is not a writable folder ({exc}); "
                    f"using {fallback} instead (set {CACHE_ENV} to a writable folder)",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return fallback


def _remove_library(lib: Path) -> None:
    """Delete `lib`, its digest and what a build killed half-way left beside them (caller holds the lock)."""
    lib.unlink(missing_ok=True)
    _digest_path(lib).unlink(missing_ok=True)
    for staged in lib.parent.glob(f".{lib.name}.*"):
        staged.unlink(missing_ok=True)
    for work in lib.parent.glob("build-*"):
        shutil.rmtree(work, ignore_errors=True)


def _compile(spec: KernelSpec, archs: Sequence[str], nvcc: str, lib: Path) -> None:
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
                spec.module_name,
                cuda_files=[str(CSRC / name) for name in spec.sources],
                extra_cuda_cflags=list(CUDA_FLAGS),
                extra_include_paths=[str(CSRC)],
                # Some toolkits keep libcudart under lib/ rather than the lib64/ tvm-ffi uses, or
                # only as libcudart.so.N.
                extra_ldflags=[f"-L{d}" for d in cudart_link_dirs(Path(nvcc).parent.parent, work)],
                build_directory=str(work),
                backend="cuda",
            )
        shutil.copyfile(built, staged)
        _digest_path(lib).write_text(_sha256(staged))
        os.replace(staged, lib)
    finally:
        staged.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)


def library_path(spec: KernelSpec, archs: Sequence[str], cache_dir: Path | None = None) -> Path | None:
    """Where `build(spec, archs)` puts its library, or None when no toolkit is found to key it by."""
    nvcc = find_nvcc()
    if nvcc is None:
        return None
    root = cache_dir if cache_dir is not None else cache_root()
    return root / cache_key(spec, sorted({normalize_arch(a) for a in archs}), nvcc) / spec.library


def is_cached(spec: KernelSpec, archs: Sequence[str], cache_dir: Path | None = None) -> bool:
    """True when a finished, intact library for `spec` and `archs` is already in the cache."""
    try:
        lib = library_path(spec, archs, cache_dir)
    except (ImportError, OSError):
        return False
    return lib is not None and _is_valid(lib)


def arch_reason(arch: str) -> str | None:
    """Why the kernels cannot run on (or be built for) this 'M.m' architecture, None when they can."""
    major, minor = normalize_arch(arch).removesuffix("a").split(".")
    if (int(major), int(minor)) >= MIN_CAPABILITY:
        return None
    need = ".".join(map(str, MIN_CAPABILITY))
    return f"compute capability {arch} is older than the kernels' minimum {need} (sm_{need.replace('.', '')})"


def _tvm_ffi_reason(module: str) -> str | None:
    """Why tvm-ffi's `module` (its loader, or its builder `tvm_ffi.cpp`) cannot be imported."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"apache-tvm-ffi is not installed or not importable ({exc})"
    return None


def loader_reason() -> str | None:
    """Why no module can be loaded here, bundled or built (tvm-ffi missing), None when one can."""
    return _tvm_ffi_reason("tvm_ffi")


def toolchain_reason() -> str | None:
    """Why no kernel can be built here (tvm-ffi missing, no nvcc), None when one can."""
    reason = _tvm_ffi_reason("tvm_ffi.cpp")
    if reason is not None:
        return reason
    if find_nvcc() is None:
        searched = ", ".join(["$CUDA_HOME", "$CUDA_PATH", *DEFAULT_CUDA_HOMES])
        return f"nvcc not found: no CUDA toolkit in {searched} or on PATH (install one or set CUDA_HOME)"
    return None


def build(spec: KernelSpec, archs: Sequence[str], cache_dir: Path | None = None) -> Path:
    """Compile `spec` for `archs` (e.g. ['9.0', '10.0']) unless cached; return the library path.

    Needs nvcc but no GPU. Raises ValueError for an unrecognized architecture and BuildError naming
    the cause for anything that stops the build.
    """
    archs = sorted({normalize_arch(a) for a in archs})
    if not archs:
        raise BuildError("no CUDA architecture given")
    # Checked first: without tvm-ffi or nvcc nothing can be built, whatever else is installed.
    reason = toolchain_reason()
    if reason is not None:
        raise BuildError(reason)
    nvcc = find_nvcc()
    assert nvcc is not None
    try:
        key = cache_key(spec, archs, nvcc)
    except OSError as exc:
        raise BuildError(f"cannot read the kernel sources in {CSRC} ({exc})") from exc
    try:
        lib = _writable_cache(cache_dir if cache_dir is not None else cache_root()) / key / spec.library
    except OSError as exc:
        raise BuildError(f"no folder to build the kernels in ({exc})") from exc
    with _build_lock:
        if _is_valid(lib):
            return lib
        try:
            lib.parent.mkdir(parents=True, exist_ok=True)
            with _file_lock(lib.parent / ".lock"):
                if not _is_valid(lib):  # another process may have finished the build while we waited
                    _compile(spec, archs, nvcc, lib)
        except Exception as exc:
            raise BuildError(f"building the {spec.name} kernel in {lib.parent} failed: {exc}") from exc
    return lib


def device_arch(device: Any) -> str:
    """The 'M.m' compute capability of a CUDA device."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


def _load(lib: Path) -> Any:
    import tvm_ffi

    return tvm_ffi.load_module(str(lib))


def _build_and_load(spec: KernelSpec, arch: str) -> tuple[Any, str]:
    """Load one module and say where it came from: the bundled one where it covers `arch` and loads,
    else the cached or freshly built one (see `_jit_load`)."""
    bundled = bundled_library(spec, arch)
    if bundled is not None:
        try:
            return _load(bundled), f"bundled ({bundled.name})"
        except Exception as exc:  # e.g. a tvm-ffi whose ABI differs: the JIT build may still work
            warnings.warn(
                f"flux2-fused: the bundled {spec.name} module did not load ({exc}); building it instead",
                RuntimeWarning,
                stacklevel=4,
            )
    cached = is_cached(spec, [arch])
    module = _jit_load(spec, arch)
    return module, "cache" if cached else "built now"


def _jit_load(spec: KernelSpec, arch: str) -> Any:
    """Build (or find in the cache) and load one module.

    A library whose bytes match its digest can still fail to load (say, built by a toolchain whose
    runtime is gone, or damaged together with its digest), and rebuilding it is cheaper than running
    eager for the rest of the process: so it is deleted and rebuilt once before BuildError is raised.
    """
    lib = build(spec, [arch])
    try:
        return _load(lib)
    except Exception as first:
        with _build_lock, _file_lock(lib.parent / ".lock"):
            _remove_library(lib)
        lib = build(spec, [arch])
        try:
            return _load(lib)
        except Exception as exc:
            raise BuildError(f"loading {lib} failed, also after a rebuild: {exc} (first: {first})") from exc


# The one cache of loaded modules, failures included: a module that could not be built is not
# rebuilt on every call, the same BuildError is raised again. `_origins` says where each came from.
_loaded: dict[tuple[KernelSpec, str], Any] = {}
_origins: dict[tuple[KernelSpec, str], str] = {}
_load_lock = threading.Lock()


def module_origin(spec: KernelSpec, arch: str) -> str | None:
    """Where the loaded module of `spec` for `arch` came from: "bundled (file)", "cache", "built now",
    or "unavailable: reason"; None before the first load."""
    return _origins.get((spec, arch))


def module_source(spec: KernelSpec, arch: str) -> tuple[str | None, str | None]:
    """Where `load_module(spec, arch)` takes (or took) its module, without loading or building it:
    (source, None), the source "bundled (file)", "cache" or "JIT build" (built on first use with the
    local toolkit), or once loaded what the load said; (None, why) where no module can be had. The
    one answer to "which kernels can run here", in the order the loader tries them."""
    origin = module_origin(spec, arch)
    if origin is not None:
        return (
            (None, origin.removeprefix("unavailable: "))
            if origin.startswith("unavailable")
            else (origin, None)
        )
    reason = arch_reason(arch) or loader_reason()
    if reason is not None:
        return None, reason
    bundled = bundled_library(spec, arch)
    if bundled is not None:
        return f"bundled ({bundled.name})", None
    reason = toolchain_reason()
    if reason is not None:
        return None, f"no bundled module for sm {arch}, and {reason}"
    return ("cache" if is_cached(spec, [arch]) else "JIT build"), None


def load_module(spec: KernelSpec, arch: str) -> Any:
    """The loaded module of `spec` for one architecture, built on first use; raises BuildError."""
    key = (spec, arch)
    entry = _loaded.get(key)
    if entry is None:
        with _load_lock:
            entry = _loaded.get(key)
            if entry is None:
                try:
                    entry, _origins[key] = _build_and_load(spec, arch)
                except Exception as exc:
                    entry = exc if isinstance(exc, BuildError) else BuildError(f"{type(exc).__name__}: {exc}")
                    _origins[key] = f"unavailable: {entry}"
                _loaded[key] = entry
    if isinstance(entry, BuildError):
        raise entry
    return entry


_device_arch: dict[Any, str] = {}


def module_for(spec: KernelSpec, device: Any) -> Any:
    """`load_module(spec, device's architecture)`: the per-launch lookup, two dict hits when loaded."""
    arch = _device_arch.get(device)
    if arch is None:
        arch = device_arch(device)
        reason = arch_reason(arch)
        if reason is not None:  # nothing to build for it: nvcc would fail on the sm_80 instructions
            raise BuildError(reason)
        _device_arch[device] = arch
    return load_module(spec, arch)
