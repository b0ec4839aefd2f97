"""Prebuilt kernels for a wheel: one tvm-ffi module per op, for the common GPU architectures.

A user who installs the wheel needs no CUDA toolkit and waits for no build: `jit` loads the bundled
module of each op where it covers the GPU (and its manifest says it was built from the very sources
installed), and falls back to its cache and a JIT build elsewhere. The exactness check stays: each
op still runs its self-check against the user's own torch on first use.

How a bundled module differs from a JIT-built one, and why:
- machine code for sm_80, 86, 89, 90, 100 and 120 and PTX for compute_120, so GPUs newer than the
  list run it through the driver's PTX compiler (a JIT module has its one GPU's machine code);
- the CUDA runtime linked statically (`-cudart static`): the module does not depend on one CUDA
  runtime version, so it runs beside torch built for CUDA 12 or 13, on any driver that supports the
  toolkit it was built with; it needs only libtvm_ffi (loaded by tvm-ffi), the C/C++ runtime and glibc;
- the same compiler flags otherwise (`jit.CUDA_FLAGS`, -O2, as tvm-ffi's JIT build).

`build_bundle(folder)` writes the libraries and `manifest.json` (per op: the library, its source
digest, architectures, PTX; the nvcc and tvm-ffi versions); `flux2-fused build --bundle DIR` calls
it, and setup.py calls it into the wheel when FLUX2_FUSED_BUNDLE_KERNELS=1.
"""

from __future__ import annotations

import json
import struct
import subprocess
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


def nvcc_command(
    spec: jit.KernelSpec, nvcc: str, output: Path, archs: Sequence[str], ptx: str | None
) -> list[str]:
    """One nvcc call that compiles and links `spec` into a self-contained module at `output`."""
    import tvm_ffi.libinfo

    include = Path(tvm_ffi.libinfo.find_include_path())
    library = Path(tvm_ffi.libinfo.find_libtvm_ffi())
    return [
        nvcc,
        "-shared",
        "-Xcompiler",
        "-fPIC",
        "-O2",
        *jit.CUDA_FLAGS,
        "-cudart",
        "static",
        *gencode_flags(archs, ptx),
        f"-I{include}",
        f"-I{tvm_ffi.libinfo.find_dlpack_include_path()}",
        f"-I{jit.CSRC}",
        *(str(jit.CSRC / name) for name in spec.sources),
        f"-L{library.parent}",
        "-ltvm_ffi",
        "-o",
        str(output),
    ]


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
    nvcc = jit.find_nvcc()
    assert nvcc is not None
    specs = list(specs) if specs is not None else [op.spec for op in OPS]
    folder.mkdir(parents=True, exist_ok=True)

    def compile_one(spec: jit.KernelSpec) -> None:
        command = nvcc_command(spec, nvcc, folder / spec.library, archs, ptx)
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise jit.BuildError(f"bundling the {spec.name} kernel failed:\n{done.stderr.strip()}")

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(compile_one, specs))
    manifest = {
        "nvcc": jit._nvcc_version(nvcc),
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


# A fatbin (an ELF section `.nv_fatbin`): blobs, each a header (magic, version, header size, size)
# then entries, each a header (kind: 1 PTX, 2 machine code; ...; its size; ...; the sm version).
_FATBIN_MAGIC = 0xBA55ED50
_ENTRY_KINDS = {1: "ptx", 2: "sm"}


def _elf_section(data: bytes, wanted: str) -> bytes:
    """The bytes of one section of a 64-bit little-endian ELF file (empty when absent)."""
    (offset,) = struct.unpack_from("<Q", data, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", data, 0x3A)

    def header(i: int) -> tuple:
        return struct.unpack_from("<IIQQQQIIQQ", data, offset + i * entry_size)

    names = header(names_index)[4]
    for i in range(count):
        name, _, _, _, start, size, *_ = header(i)
        end = data.index(b"\0", names + name)
        if data[names + name : end].decode() == wanted:
            return data[start : start + size]
    return b""


def fatbin_targets(library: Path) -> set[str]:
    """What a module carries for the GPU, as {"sm_90", "ptx_120", ...}: read from its `.nv_fatbin`
    section (the toolkit's cuobjdump lists the same; not every toolkit install has it)."""
    blob = _elf_section(library.read_bytes(), ".nv_fatbin")
    targets, pos = set(), 0
    while pos + 16 <= len(blob):
        magic, _, header_size, size = struct.unpack_from("<IHHQ", blob, pos)
        if magic != _FATBIN_MAGIC:
            break
        entry, end = pos + header_size, pos + header_size + size
        while entry < end:
            kind, _, entry_header, padded, _, _, _, _, sm = struct.unpack_from("<HHIIIIIII", blob, entry)
            targets.add(f"{_ENTRY_KINDS.get(kind, f'kind{kind}')}_{sm}")
            entry += entry_header + padded
        pos = end
    return targets
