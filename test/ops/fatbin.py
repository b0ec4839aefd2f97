"""What a built module carries for the GPU, read from its ELF file without the CUDA toolkit: the
bundle tests check a wheel's modules with it where cuobjdump may be missing (not every toolkit
install has it)."""

from __future__ import annotations

import struct
from pathlib import Path

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
