"""The diffusers patch: enable, output unchanged, disable, restored (CPU and, marked gpu, CUDA)."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.integrations.diffusers import enable
from flux2_fused.models.flux2 import Flux2Config, Flux2Transformer

from ..models.test_flux2 import TINY, diffusers_model, image_ids, text_ids

attention_backend = pytest.importorskip("diffusers.models.attention_dispatch").attention_backend


def _inputs(config: Flux2Config, device: str, dtype: torch.dtype, img: int = 37, txt: int = 11) -> dict:
    gen = torch.Generator(device=device)
    gen.seed()
    return {
        "hidden_states": torch.randn(2, img, config.in_channels, generator=gen, device=device).to(dtype),
        "encoder_hidden_states": torch.randn(
            2, txt, config.joint_attention_dim, generator=gen, device=device
        ).to(dtype),
        "timestep": torch.rand(2, generator=gen, device=device),
        "img_ids": image_ids(img).to(device),
        "txt_ids": text_ids(txt).to(device),
        "guidance": torch.full((2,), 4.0, device=device) if config.guidance_embeds else None,
    }


def _roundtrip(config: Flux2Config, device: str, dtype: torch.dtype, **sizes: int) -> None:
    ours = Flux2Transformer.random(config, seed=5, device=device, dtype=dtype)
    reference = diffusers_model(ours)
    inputs = _inputs(config, device, dtype, **sizes)
    with torch.inference_mode(), attention_backend("native"):
        before = reference(**inputs).sample
        handle = enable(reference)
        assert enable(reference) is handle  # idempotent
        patched = reference(**inputs, return_dict=False)[0]
        handle.disable()
        after = reference(**inputs).sample
    assert torch.equal(patched, before) and torch.equal(after, before)
    assert "forward" not in reference.__dict__


def test_patch_on_cpu_is_transparent():
    _roundtrip(TINY, "cpu", torch.float32)


def test_patch_rejects_other_modules():
    with pytest.raises(TypeError, match="Flux2Transformer2DModel"):
        enable(torch.nn.Linear(2, 2))


@pytest.mark.gpu
def test_patch_on_klein_4b_is_bit_identical():
    _roundtrip(Flux2Config.preset("klein-4b"), "cuda", torch.bfloat16, img=1024, txt=128)
