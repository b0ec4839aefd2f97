"""The diffusers host of the benchmarks: diffusers' FLUX.2 transformer holding the package's random
weights, in the setups diffusers users run it (a peft LoRA, CPU offload), switched between diffusers'
own forward and `enable()`, and a Klein pipeline of random components around it.

The tests build their diffusers models here too, so a benchmark times the setup the tests check.
diffusers, peft and accelerate are optional: each is imported where it is used, and
`check_diffusers_host` says before any work which one a request lacks.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import nn

from ..errors import BadValue
from ..models.flux2 import Flux2Config, Flux2Transformer
from .options import OFFLOADS

# The Linears a LoRA adapts, by the ends of their names inside the blocks: both families' double-block
# attention projections (`to_out.0`: in the double block `to_out` is a ModuleList, which peft refuses
# to adapt), then FLUX.2's single block's fused QKV + MLP input and output projection and its
# feed-forwards (FLUX.1's are in `bench.flux1`).
ATTENTION_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
)
LORA_TARGETS = (*ATTENTION_TARGETS, "to_qkv_mlp_proj", "to_out", "linear_in", "linear_out")
# The attributes that hold a transformer's blocks: FLUX.1's and FLUX.2's double and single blocks,
# FLUX.3's text mode blocks and the image modes' (a ModuleDict by mode) before its joint single blocks,
# Z-Image's refiners and main layers. A LoRA and a quantization reach the Linears under these; the
# embedders and the output stay plain.
BLOCK_STACKS = (
    "transformer_blocks",
    "single_transformer_blocks",
    "txt_mode_blocks",
    "mode_blocks",
    "noise_refiner",
    "context_refiner",
    "layers",
)


def check_diffusers_host(
    what: str, lora_rank: int | None = None, offload: str = "none", quantization: str = "none"
) -> None:
    """BadValue (exit status 2) naming what this environment lacks for the diffusers host with these
    options, so a run fails in one line before it builds a model; `what` names the request."""
    from ..integrations.diffusers import check_version

    try:
        check_version()
    except RuntimeError as err:
        raise BadValue(f"{what}: {str(err).removeprefix('flux2-fused: ')}") from err
    needs = {
        "--lora": ("peft", lora_rank is not None),
        "--offload model": ("accelerate", offload == "model"),
        "--quantize": ("torchao", quantization != "none"),
    }
    for option, (package, needed) in needs.items():
        if needed and importlib.util.find_spec(package) is None:
            raise BadValue(f"{option} needs {package}, which is not installed (pip install {package})")


def random_transformer(
    cls: type, config: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int = 0
) -> nn.Module:
    """A diffusers transformer `cls(**config)` with its own default initialization, made on `device`
    in `dtype`, reproducible from `seed` without touching the caller's random state; in eval mode, as
    `from_pretrained` returns it (the families without a model of the package's own: FLUX.1, FLUX.3)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
        torch.manual_seed(seed)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = cls(**config)
        finally:
            torch.set_default_dtype(default)
    return model.eval()


def diffusers_model(ours: Flux2Transformer) -> nn.Module:
    """diffusers' Flux2Transformer2DModel sharing `ours`'s weight storage (built on meta, loaded strictly
    with assign): no second copy, so both hosts compute with the same weights and even the 64 GB dev
    model fits twice over on a GPU that holds it once."""
    from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel

    with torch.device("meta"):
        model = Flux2Transformer2DModel(**ours.config.to_diffusers())
    model.load_state_dict(ours.state_dict(), strict=True, assign=True)
    return model


def add_lora(
    model: nn.Module, rank: int, name: str = "default", seed: int = 0, targets: tuple[str, ...] = LORA_TARGETS
) -> None:
    """A peft LoRA adapter of rank `rank` (alpha = rank) on every Linear of the blocks (BLOCK_STACKS)
    that `targets` names (default: FLUX.2's LORA_TARGETS), A and B both random (peft's default init
    leaves B zero: an adapter that changes nothing), reproducible from `seed` without touching the
    caller's random state."""
    import peft

    # A Linear that already has an adapter is peft's wrapper, with the Linear as its `base_layer`.
    names = (
        path.removesuffix(".base_layer") for path, m in model.named_modules() if isinstance(m, nn.Linear)
    )
    in_blocks = (p for p in names if p.startswith(tuple(f"{stack}." for stack in BLOCK_STACKS)))
    paths = sorted({p for p in in_blocks if any(p.endswith(f".{t}") for t in targets)})
    config = peft.LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False, target_modules=paths)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.add_adapter(config, adapter_name=name)


def offload(model: nn.Module, kind: str, device: torch.device) -> None:
    """Put the model's weights on the CPU between uses, as diffusers users do (`kind` from OFFLOADS):
    - model: accelerate's `cpu_offload_with_hook`, the hook diffusers' `enable_model_cpu_offload`
      puts on each model of a pipeline. The model moves to `device` at its first call and stays
      there until a pipeline's next model runs, so the steps of a denoise loop pay only the hook's
      per-call work (moving the arguments, checking every parameter's device);
    - group: diffusers' group offloading, one block a group: each block's weights are copied to
      `device` just before it runs (on a side stream on CUDA, overlapping the previous block) and
      dropped after, every step."""
    if kind == "none":
        return
    if kind not in OFFLOADS:
        raise ValueError(f"unknown offload {kind!r}; choose one of {', '.join(OFFLOADS)}")
    model.to("cpu")
    if kind == "model":
        from accelerate import cpu_offload_with_hook

        cpu_offload_with_hook(model, device)
    else:
        model.enable_group_offload(
            onload_device=device,
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
            use_stream=device.type == "cuda",  # streams exist only on CUDA
        )


def quantize(model: nn.Module, kind: str) -> None:
    """torchao's dynamic quantization (`kind` from options.QUANTIZATIONS) of every Linear in the
    blocks (BLOCK_STACKS), as users quantize a FLUX transformer (the embedders, the modulations
    outside the blocks and the output projection stay):
    float8 activations and weights scaled per row or per tensor, or int8. Inductor's settings are
    left as they are (`set_inductor_config=False`): torchao's recommended ones turn on Inductor's
    coordinate-descent autotuning, with which compiling one klein-4B float8 step took over 3.5
    minutes on an H200 (it had not finished)."""
    if kind == "none":
        return
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8DynamicActivationInt8WeightConfig,
        PerRow,
        PerTensor,
        quantize_,
    )

    configs = {
        "float8-row": lambda: Float8DynamicActivationFloat8WeightConfig(
            granularity=PerRow(), set_inductor_config=False
        ),
        "float8-tensor": lambda: Float8DynamicActivationFloat8WeightConfig(
            granularity=PerTensor(), set_inductor_config=False
        ),
        "int8": lambda: Int8DynamicActivationInt8WeightConfig(set_inductor_config=False),
    }
    for stack in BLOCK_STACKS:
        if hasattr(model, stack):
            quantize_(getattr(model, stack), configs[kind]())


def diffusers_host(
    config: Flux2Config,
    device: torch.device,
    dtype: torch.dtype,
    lora_rank: int | None = None,
    offload_kind: str = "none",
    seed: int = 0,
    quantization: str = "none",
) -> nn.Module:
    """The diffusers host of the step benchmark: diffusers' model with the package's random weights
    (`Flux2Transformer.random(config, seed)`), in eval mode as `from_pretrained` returns it, quantized,
    with a LoRA of `lora_rank` and then the offload, the order of a user who loads a pipeline and its
    adapter, then turns offloading on (and then `enable()`)."""
    model = diffusers_model(Flux2Transformer.random(config, seed=seed, device=device, dtype=dtype)).eval()
    return set_up(model, device, lora_rank, offload_kind, quantization)


def set_up(
    model: nn.Module,
    device: torch.device,
    lora_rank: int | None = None,
    offload_kind: str = "none",
    quantization: str = "none",
    lora_targets: tuple[str, ...] = LORA_TARGETS,
) -> nn.Module:
    """A diffusers transformer quantized, with a LoRA of `lora_rank` on `lora_targets`, then offloaded:
    the order of a user who loads a pipeline and its adapter, then turns offloading on."""
    quantize(model, quantization)
    if lora_rank is not None:
        add_lora(model, lora_rank, targets=lora_targets)
    offload(model, offload_kind, device)
    return model


def use_fused(target: Any, fused: bool) -> None:
    """Switch a diffusers transformer (or a pipeline's) between `enable()` (True) and diffusers' own
    forward (False), so a benchmark alternates them call by call on one model. Does nothing when it
    is already in that mode, so no switching work is timed as part of a step."""
    from ..integrations.diffusers import enable

    handle = getattr(getattr(target, "transformer", target), "_flux2_fused_handle", None)
    if fused and handle is None:
        enable(target)
    elif not fused and handle is not None:
        handle.disable()


def random_vae(cls: type, transformer: nn.Module, seed: int = 0, **config: Any) -> nn.Module:
    """A diffusers autoencoder `cls(**config)` with its default initialization from `seed` (the
    caller's random state untouched), on the transformer's device and in its dtype, in eval mode as
    `from_pretrained` returns it: the VAE of a benchmark's pipeline, whose weights only have to be the
    same in both modes."""
    weight = next(transformer.parameters())
    with (
        torch.random.fork_rng(devices=[weight.device] if weight.is_cuda else []),
        torch.device(weight.device),
    ):
        torch.manual_seed(seed)
        return cls(**config).to(weight.dtype).eval()


def klein_pipeline(cls: type, transformer: nn.Module, seed: int = 0) -> Any:
    """A Flux2KleinPipeline (or a pipeline class with its components, e.g. Flux2KleinInpaintPipeline,
    Flux2Pipeline)
    around `transformer`: diffusers' AutoencoderKLFlux2 at its default config with random weights on
    the transformer's device and dtype, diffusers' default FlowMatchEulerDiscreteScheduler, and no text
    encoder, so callers pass prompt embeddings. The progress bar is off (it would interleave with the
    reports)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler

    pipe = cls(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=random_vae(AutoencoderKLFlux2, transformer, seed),
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
