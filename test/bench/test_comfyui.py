"""`step --host comfyui`'s CPU side: its options refused in one line before any work, and ComfyUI's
model at a FLUX.2 config (`comfy_params`) built with random weights, equal to itself with enable()."""

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
        ({"configs": ["klein-4b", "flux1-dev"]}, "--host comfyui runs FLUX.2 sizes"),
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
