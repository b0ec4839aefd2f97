"""`step --host comfyui`'s CPU side: its options refused in one line before any work, ComfyUI's
model at a FLUX.2 config (`comfy_params`) built with random weights, equal to itself with enable(),
and the FLUX.1 sizes as ComfyUI's model detection builds them."""

from __future__ import annotations

import argparse

import pytest
import torch

from flux2_fused.bench import comfyui
from flux2_fused.errors import BadValue
from flux2_fused.models.flux2 import Flux2Config

from ..integrations.comfyui import support


def _args(**changes: object) -> argparse.Namespace:
    args = {"configs": ["klein-4b"], "weights": None, "lora": None, "offload": "none", "quantize": "none"}
    return argparse.Namespace(**{**args, **changes})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"configs": ["klein-4b", "flux3-klein"]}, "--host comfyui runs .*, not flux3-klein"),
        ({"lora": 16}, "apply to --host package or diffusers"),
        ({"quantize": "float8-row"}, "apply to --host package or diffusers"),
    ],
)
def test_options_it_cannot_run_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(BadValue, match=message):
        comfyui.check_options(_args(**changes))


def test_comfyui_must_be_importable(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.delitem(__import__("sys").modules, "comfy.ldm.flux.model", raising=False)
    monkeypatch.delenv(comfyui.ENV, raising=False)
    assert "set FLUX2_FUSED_COMFYUI" in comfyui.comfyui_reason()
    monkeypatch.setenv(comfyui.ENV, str(tmp_path))
    assert "holds no ComfyUI" in comfyui.comfyui_reason()


def test_a_flux2_config_builds_comfyuis_model() -> None:
    """The tiny FLUX.2 config as ComfyUI's model: its forward runs, and enable() gives its bits."""
    support.import_comfy()
    from flux2_fused.integrations.comfyui import enable

    model = comfyui.random_model("tiny", torch.device("cpu"), torch.bfloat16)
    config = Flux2Config.preset("tiny")
    assert model.params.hidden_size == config.num_attention_heads * config.attention_head_dim
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "x": torch.randn(1, config.in_channels, 3, 5, generator=gen).bfloat16(),
        "timestep": torch.full((1,), 0.5),
        "context": torch.randn(1, 6, config.joint_attention_dim, generator=gen).bfloat16(),
        "guidance": torch.full((1,), 4.0, dtype=torch.bfloat16),
    }
    with torch.inference_mode():
        expected = model(**inputs)
        handle = enable(model)
        assert torch.equal(model(**inputs), expected)
        handle.disable()


@pytest.mark.parametrize("name", ["flux1-dev", "flux1-schnell"])
def test_flux1_sizes_are_comfyuis_flux1(name: str) -> None:
    """A FLUX.1 size builds ComfyUI's FLUX.1 (on the meta device: no memory): 19 + 38 blocks of 3072,
    each with its own modulation, tanh-GELU MLPs, the pooled-text embedder, guidance for dev only."""
    flux = support.import_comfy()
    import comfy.ops

    params = comfyui.preset_params(name)
    model = flux.Flux(**params, device="meta", dtype=torch.bfloat16, operations=comfy.ops.disable_weight_init)
    assert (len(model.double_blocks), len(model.single_blocks)) == (19, 38)
    assert model.params.hidden_size == 3072 and model.params.patch_size == 2
    block = model.double_blocks[0]
    assert block.img_mod is not None and isinstance(block.img_mod.lin, torch.nn.Linear)
    assert isinstance(block.img_mlp[1], torch.nn.GELU) and block.img_mlp[1].approximate == "tanh"
    assert model.vector_in is not None and (model.params.guidance_embed == (name == "flux1-dev"))
    comfyui.check_options(_args(configs=[name, "klein-4b"]))  # accepted
