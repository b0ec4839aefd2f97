"""Prebuilt kernels for a wheel: one tvm-ffi module per op, for the common GPU architectures.

A user who installs the wheel needs no CUDA toolkit and waits for no build: `jit` loads the bundled
module of each op where it covers the GPU (and its manifest says it was built from the very sources
installed), and falls back to its cache and a JIT build elsewhere. The exactness check stays: each
op still runs its self-check against the user's own torch on first use.

How a bundled module differs from a JIT-built one, and why:
- machine code for sm_80, 86, 89, 90, 100 and 120 and PTX for compute_120, so GPUs newer than the
  list run it through the driver's PTX compiler (a JIT module has its one GPU's machine code);
- the CUDA runtime linked statically (`libcudart_static.a`): the module does not depend on one CUDA
  runtime version, so it runs beside torch built for CUDA 12 or 13, on any driver that supports the
  toolkit it was built with; it needs only libtvm_ffi (loaded by tvm-ffi), the C/C++ runtime and glibc;
- linked by zig's linker (the `ziglang` package) against glibc 2.28's symbol versions, so the wheel is
  manylinux_2_28 whatever glibc the build machine has (the static CUDA runtime would otherwise bind
  its pthread, dl and shm calls at the build machine's glibc: 2.34 on any glibc 2.34+). The link
  allows no undefined symbol, so a call that only a newer glibc has (its headers may rename one,
  e.g. `__isoc23_strtol` on 2.38+) fails the build rather than the wheel;
- only its `__tvm_ffi_*` functions exported, and the one libstdc++ member it uses that is newer than
  manylinux_2_28 allows (`LIBSTDCXX_MEMBERS`) linked in, hidden;
- the same compiler flags otherwise (`jit.CUDA_FLAGS`, -O2, as tvm-ffi's JIT build).

`build_bundle(folder)` writes the libraries and `manifest.json` (per op: the library, its source
digest, architectures, PTX; the nvcc and tvm-ffi versions); `flux2-fused build --bundle DIR` calls
it, and setup.py calls it into the wheel when FLUX2_FUSED_BUNDLE_KERNELS=1.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import jit

# The architectures a bundle carries machine code for, and the one whose PTX it carries.
ARCHS = ("8.0", "8.6", "8.9", "9.0", "10.0", "12.0")
PTX = "12.0"


def gencode_flags(archs: Sequence[str], ptx: str | None) -> list[str]:
    """nvcc's -gencode flags: machine code for each of `archs`, and PTX for `ptx`."""
    flags = []
    for arch in archs:
        digits = jit.normalize_arch(arch).replace(".", "")
        flags.append(f"-gencode=arch=compute_{digits},code=sm_{digits}")
    if ptx is not None:
        digits = jit.normalize_arch(ptx).replace(".", "")
        flags.append(f"-gencode=arch=compute_{digits},code=compute_{digits}")
    return flags


# The glibc whose symbol versions the modules are linked against, and the wheel's platform tag.
GLIBC = "2.28"
PLATFORM = "manylinux_2_28_x86_64"
# Members of the host compiler's libstdc++.a linked into each module, hidden. tvm-ffi's headers build
# error messages in a default-constructed std::ostringstream, a constructor libstdc++.so exports only
# since GLIBCXX_3.4.26 (GCC 9), past manylinux_2_28's 3.4.24; this member instantiates it, so the module
# carries that code and needs only older symbols of the system's libstdc++ (RHEL's developer toolsets
# link their newer parts into binaries the same way).
LIBSTDCXX_MEMBERS = ("sstream-inst.o",)
# The linker's version script: the module's tvm-ffi functions are all it exports.
EXPORTS = "{ global: __tvm_ffi_*; local: *; };\n"


def find_zig() -> list[str] | None:
    """The command of zig's C compiler driver: the `ziglang` package's, else a `zig` on PATH."""
    if importlib.util.find_spec("ziglang") is not None:
        return [sys.executable, "-m", "ziglang"]
    zig = shutil.which("zig")
    return None if zig is None else [zig]


def compile_command(
    spec: jit.KernelSpec, nvcc: str, output: Path, archs: Sequence[str], ptx: str | None
) -> list[str]:
    """One nvcc call that compiles `spec` into an object file at `output` (host code by the toolkit's
    host compiler, device code for `archs` and `ptx`)."""
    import tvm_ffi.libinfo

    return [
        nvcc,
        "-c",
        "-Xcompiler",
        "-fPIC",
        "-O2",
        *jit.CUDA_FLAGS,
        *gencode_flags(archs, ptx),
        f"-I{tvm_ffi.libinfo.find_include_path()}",
        f"-I{tvm_ffi.libinfo.find_dlpack_include_path()}",
        f"-I{jit.CSRC}",
        *(str(jit.CSRC / name) for name in spec.sources),
        "-o",
        str(output),
    ]


def _compiler_file(name: str) -> Path:
    """A file of the C++ runtime of nvcc's host compiler ($NVCC_CCBIN, else the g++ on PATH, as nvcc
    picks it), by its `-print-file-name`."""
    compiler = os.environ.get("NVCC_CCBIN") or shutil.which("g++")
    if compiler is None:
        raise jit.BuildError("bundling needs g++, nvcc's host compiler, on PATH (or $NVCC_CCBIN)")
    found = Path(
        subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    )
    if not found.is_absolute() or not found.exists():
        raise jit.BuildError(f"g++ does not know where {name} is")
    return found


def cudart_static(nvcc: str) -> Path:
    """The toolkit's static CUDA runtime, beside the nvcc that compiles the modules."""
    home = Path(nvcc).resolve().parent.parent
    for folder in ("lib64", "lib", "targets/x86_64-linux/lib"):
        if (home / folder / "libcudart_static.a").exists():
            return home / folder / "libcudart_static.a"
    raise jit.BuildError(f"no libcudart_static.a in the toolkit at {home}")


def link_command(
    zig: Sequence[str], objects: Sequence[Path], cudart: Path, exports: Path, output: Path
) -> list[str]:
    """zig's linker call that makes one module of `objects`: glibc symbols bound at `GLIBC`, the CUDA
    runtime static, libtvm_ffi, the system's libstdc++ and libgcc_s dynamic, only `EXPORTS` exported,
    no symbol left undefined."""
    import tvm_ffi.libinfo

    return [
        *zig,
        "cc",
        "-target",
        f"x86_64-linux-gnu.{GLIBC}",
        "-shared",
        "-fPIC",
        *map(str, objects),
        str(cudart),
        f"-L{Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent}",
        "-ltvm_ffi",
        str(_compiler_file("libstdc++.so.6")),
        str(_compiler_file("libgcc_s.so.1")),
        f"-Wl,--version-script={exports}",
        "-Wl,--no-undefined",
        "-o",
        str(output),
    ]


def _run(command: list[str], what: str, cwd: Path) -> None:
    """One build tool's call in `cwd`; its error output in the BuildError when it fails."""
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=cwd)
    if done.returncode != 0:
        raise jit.BuildError(f"bundling the {what} kernel failed:\n{done.stderr.strip()}")


def build_bundle(
    folder: Path,
    specs: Sequence[jit.KernelSpec] | None = None,
    archs: Sequence[str] = ARCHS,
    ptx: str | None = PTX,
    jobs: int = 2,
) -> dict:
    """Compile every op's module into `folder` and write its manifest; returns the manifest. Needs
    nvcc and tvm-ffi, no GPU. Raises jit.BuildError naming the op whose build failed."""
    import tvm_ffi

    from . import OPS

    reason = jit.toolchain_reason()
    if reason is not None:
        raise jit.BuildError(reason)
    zig = find_zig()
    if zig is None:
        raise jit.BuildError("bundling links with zig: pip install ziglang")
    nvcc = jit.find_nvcc()
    assert nvcc is not None
    specs = list(specs) if specs is not None else [op.spec for op in OPS]
    folder = folder.resolve()  # the tools run in a scratch folder
    folder.mkdir(parents=True, exist_ok=True)
    cudart = cudart_static(nvcc)

    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        exports = work / "exports.map"
        exports.write_text(EXPORTS)
        _run([*zig, "ar", "x", str(_compiler_file("libstdc++.a")), *LIBSTDCXX_MEMBERS], "libstdc++", work)
        members = [work / name for name in LIBSTDCXX_MEMBERS]

        def build_one(spec: jit.KernelSpec) -> None:
            objects = [work / f"{spec.name}.o"]
            _run(compile_command(spec, nvcc, objects[0], archs, ptx), spec.name, work)
            _run(
                link_command(zig, [*objects, *members], cudart, exports, folder / spec.library),
                spec.name,
                work,
            )

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            list(pool.map(build_one, specs))
    manifest = {
        "nvcc": jit._nvcc_version(nvcc),
        "glibc": GLIBC,
        "tvm_ffi": tvm_ffi.__version__,
        "modules": {
            spec.name: {
                "library": spec.library,
                "sources": jit.source_digest(spec),
                "archs": [jit.normalize_arch(a) for a in archs],
                "ptx": None if ptx is None else jit.normalize_arch(ptx),
            }
            for spec in specs
        },
    }
    (folder / jit.BUNDLE_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
