"""The diffusers versions whose transformers the families follow, checked once per process."""

from __future__ import annotations

import functools
import importlib.metadata

SUPPORTED_DIFFUSERS = ((0, 37), (0, 43))  # [min, max): the FLUX.2 transformer's math is unchanged here


@functools.cache
def check_version() -> str:
    """The installed diffusers version; RuntimeError when it is missing or outside the range whose
    transformers the patch follows. Looked up once (enable() is called per benchmark step)."""
    try:
        version = importlib.metadata.version("diffusers")
    except importlib.metadata.PackageNotFoundError as err:
        raise RuntimeError("flux2-fused: diffusers is not installed") from err
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    low, high = SUPPORTED_DIFFUSERS
    if not (low <= parts < high):
        raise RuntimeError(
            f"flux2-fused: diffusers {version} is outside the supported range "
            f">={low[0]}.{low[1]},<{high[0]}.{high[1]} (FLUX.2's transformer may differ there)"
        )
    return version
