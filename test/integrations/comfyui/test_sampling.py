"""ComfyUI's own sampling (`comfy.sample.sample`: its sampler, its CFG batching, its model wrapper) of a
tiny random FLUX.2 that ComfyUI's model detection loads from a state dict: the MODEL from the node
gives ComfyUI's latents bit for bit with every block through the block code, in both orders of node
and LoRA, after clones (also onto another model object), and the MODEL given to the node is left as
it was."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from ...conftest import count_block_code
from . import support

support.import_with_stand_ins(
    "comfy.sd", "comfy.sample", "comfy_extras.nodes_easycache", "flux2_fused.integrations.comfyui.nodes"
)

import comfy.model_management  # noqa: E402
import comfy.sample  # noqa: E402
import comfy.sd  # noqa: E402
from comfy_extras.nodes_easycache import EasyCacheNode  # noqa: E402

from flux2_fused.integrations.comfyui.nodes import FluxFused  # noqa: E402
from flux2_fused.models.flux2 import comfyui as binding  # noqa: E402

# FLUX.2 latents have 128 channels (ComfyUI's Flux2 latent format).
CHANNELS = {"in_channels": 128, "out_channels": 128}


def _state_dict(seed: int) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors (BFL's names, as ComfyUI loads them) of the tiny FLUX.2, in float32."""
    return support.flux(torch.float32, seed=seed, **CHANNELS).state_dict()


def _fp8_scaled(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint in ComfyUI's fp8 "scaled" format (its QUANTIZATION.md): each block Linear's weight
    in float8_e4m3fn with a per-tensor `weight_scale`, and the layer's `comfy_quant` entry naming the
    format, from which ComfyUI's loader picks its mixed-precision ops."""
    out = {}
    for name, tensor in state_dict.items():
        layer = name.removesuffix(".weight")
        if (
            name.endswith(".weight")
            and tensor.dim() == 2
            and name.startswith(("double_blocks", "single_blocks"))
        ):
            scale = tensor.abs().amax() / torch.finfo(torch.float8_e4m3fn).max
            out[name] = (tensor / scale).to(torch.float8_e4m3fn)
            out[f"{layer}.weight_scale"] = scale.float()
            out[f"{layer}.comfy_quant"] = torch.tensor(
                list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8
            )
        else:
            out[name] = tensor
    return out


def _patcher(seed: int = 0, fp8_scaled: bool = False) -> Any:
    """A ModelPatcher as ComfyUI's loader makes it: model detection, `model_base.Flux2`, bf16 (its fp8
    scaled checkpoint with `fp8_scaled`)."""
    state_dict = _state_dict(seed)
    patcher = comfy.sd.load_diffusion_model_state_dict(
        _fp8_scaled(state_dict) if fp8_scaled else state_dict, model_options={"dtype": torch.bfloat16}
    )
    assert patcher is not None
    return patcher


def _sample(patcher: Any, cfg: float = 3.0, steps: int = 3) -> torch.Tensor:
    """ComfyUI's sampler on an empty 6x5 latent with a prompt and a negative prompt: with cfg > 1 each
    step is one model call of the two, batched."""
    latent = comfy.sample.fix_empty_latent_channels(patcher, torch.zeros(1, 128, 6, 5))
    noise = comfy.sample.prepare_noise(latent, 42)
    gen = torch.Generator().manual_seed(1)
    positive, negative = (
        [[torch.randn(1, 7, support.TINY["context_in_dim"], generator=gen), {}]] for _ in range(2)
    )
    out = comfy.sample.sample(
        patcher, noise, steps, cfg, "euler", "simple", positive, negative, latent, seed=42, disable_pbar=True
    )
    comfy.model_management.unload_all_models()
    return out


def _node(patcher: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return FluxFused.execute(patcher).args[0]


def _lora(patcher: Any, seed: int = 7) -> Any:
    """A clone with a LoRA-style weight patch (ComfyUI's "diff" patches) on every block's projections."""
    clone = patcher.clone()
    gen = torch.Generator().manual_seed(seed)
    weights = {
        f"diffusion_model.{name}": ("diff", (0.05 * torch.randn(tensor.shape, generator=gen),))
        for name, tensor in _state_dict(0).items()
        if name.endswith(("qkv.weight", "linear1.weight", "linear2.weight"))
    }
    assert clone.add_patches(weights, 1.0)
    return clone


@pytest.fixture
def bodies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return count_block_code(monkeypatch, "double_block_body", binding)


def test_the_nodes_model_samples_comfyuis_latents(bodies: list[int]) -> None:
    patcher = _patcher()
    expected = _sample(patcher)
    fused = _node(patcher)
    assert torch.equal(_sample(fused), expected)
    runs = len(bodies)
    assert runs == 3 * support.TINY["depth"]  # three steps, cond and uncond in one call each
    assert torch.equal(_sample(patcher), expected)  # the MODEL given to the node: ComfyUI's own
    assert len(bodies) == runs
    assert torch.equal(_sample(fused.clone()), expected)  # a clone keeps the node's patch
    assert len(bodies) == 2 * runs


def test_fp8_scaled_weights(bodies: list[int]) -> None:
    """ComfyUI's fp8 "scaled" checkpoint (mixed-precision ops: QuantizedTensor weights with a scale,
    per-call casts): the node's latents are ComfyUI's, every block through the block code."""
    patcher = _patcher(fp8_scaled=True)
    linear = patcher.model.diffusion_model.double_blocks[0].img_attn.qkv
    assert type(linear.weight).__name__ == "QuantizedTensor"
    expected = _sample(patcher)
    assert not torch.equal(expected, _sample(_patcher()))  # the quantized weights change the latents
    assert torch.equal(_sample(_node(patcher)), expected)
    assert len(bodies) == 3 * support.TINY["depth"]


@pytest.mark.parametrize("order", ["lora-then-node", "node-then-lora"])
def test_lora_in_either_order(order: str, bodies: list[int]) -> None:
    patcher = _patcher()
    expected = _sample(_lora(patcher))
    assert not torch.equal(expected, _sample(patcher))  # the LoRA changes the latents
    fused = _node(_lora(patcher)) if order == "lora-then-node" else _lora(_node(patcher))
    assert torch.equal(_sample(fused), expected)
    assert len(bodies) == 3 * support.TINY["depth"]


def test_a_clone_onto_another_model_object_patches_that_model(bodies: list[int]) -> None:
    """A clone holding another model object (ComfyUI's non-dynamic and deep clones): its patch runs
    its own model, not the one the node patched."""
    other = _patcher(seed=5)
    expected = _sample(other)
    clone = _node(_patcher()).clone(model_override=other.get_clone_model_override())
    assert torch.equal(_sample(clone), expected)
    assert len(bodies) == 3 * support.TINY["depth"]


def test_a_model_that_is_not_flux_passes_through() -> None:
    class NotFlux:
        model = torch.nn.Module()

        def clone(self) -> NotFlux:
            return NotFlux()

    model = NotFlux()
    with pytest.warns(RuntimeWarning, match="not ComfyUI's FLUX model"):
        assert FluxFused.execute(model).args[0] is model


@pytest.mark.parametrize("order", ["cache-then-node", "node-then-cache"])
def test_a_wrapper_cache_in_either_order(order: str, bodies: list[int]) -> None:
    """ComfyUI's EasyCache (wrappers around the sampler and the diffusion model that skip model calls
    whose input changed little): its decisions read the outputs, which are ComfyUI's, so the latents
    and the calls it skips are those of EasyCache alone; the calls it makes run the block code."""

    def cache(patcher: Any) -> Any:
        return EasyCacheNode.execute(patcher, 3.0, 0.0, 1.0, False).args[0]

    patcher = _patcher()
    expected = _sample(cache(patcher), steps=8)
    fused = _node(cache(patcher)) if order == "cache-then-node" else cache(_node(patcher))
    assert torch.equal(_sample(fused, steps=8), expected)
    assert 0 < len(bodies) < 8 * support.TINY["depth"]  # some calls skipped, the others fused
