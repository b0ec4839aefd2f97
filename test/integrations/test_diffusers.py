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


class _Wrapped(torch.nn.Module):
    """What an adapter does to a Linear: the original inside, one more term beside it."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base_layer = base
        self.extra = torch.nn.Linear(base.in_features, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.extra(x)


def _wrap_a_linear(model: torch.nn.Module) -> None:
    attn = model.transformer_blocks[0].attn
    attn.to_q = _Wrapped(attn.to_q)


def _scale_a_weight(model: torch.nn.Module) -> None:
    weight = model.single_transformer_blocks[0].attn.to_out.weight
    weight.data = weight.data * 2  # new storage, as fuse_lora and offload hooks do


def _custom_processor(model: torch.nn.Module) -> None:
    from diffusers.models.transformers.transformer_flux2 import Flux2AttnProcessor

    class Custom(Flux2AttnProcessor):
        pass

    model.transformer_blocks[1].attn.set_processor(Custom())


def _to_float64(model: torch.nn.Module) -> None:
    model.to(torch.float64)


CHANGES = {
    "adapter-like wrapper": _wrap_a_linear,
    "weight storage replaced": _scale_a_weight,
    "custom attention processor": _custom_processor,
    "dtype move": _to_float64,
}


@pytest.mark.parametrize("change", CHANGES)
def test_changes_after_enable_give_diffusers_output(change: str):
    """A change the routed model does not mirror: the patched forward steps aside to diffusers' own,
    so the output is what diffusers computes with the change (never the stale weights')."""
    reference = diffusers_model(Flux2Transformer.random(TINY, seed=5))
    handle = enable(reference)
    calls = []
    handle.model.register_forward_pre_hook(lambda *_: calls.append(1))
    with torch.inference_mode(), attention_backend("native"):
        reference(**_inputs(TINY, "cpu", torch.float32))
        assert calls == [1]  # unchanged: routed
        CHANGES[change](reference)
        inputs = _inputs(TINY, "cpu", next(reference.parameters()).dtype)
        patched = reference(**inputs).sample
        handle.disable()
        expected = reference(**inputs).sample
    assert calls == [1]  # changed: not routed again
    assert torch.equal(patched, expected)


def test_in_place_weight_updates_are_seen():
    """Weights updated in place keep their storage, which the routed model shares: it stays routed."""
    reference = diffusers_model(Flux2Transformer.random(TINY, seed=5))
    handle = enable(reference)
    inputs = _inputs(TINY, "cpu", torch.float32)
    with torch.inference_mode(), attention_backend("native"):
        reference.transformer_blocks[0].ff.linear_in.weight.mul_(1.5)
        patched = reference(**inputs).sample
        handle.disable()
        expected = reference(**inputs).sample
    assert torch.equal(patched, expected)


def test_deepcopy_of_a_patched_model_computes_its_own_weights():
    import copy

    reference = diffusers_model(Flux2Transformer.random(TINY, seed=5))
    enable(reference)
    clone = copy.deepcopy(reference)
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(0.5)
    inputs = _inputs(TINY, "cpu", torch.float32)
    with torch.inference_mode(), attention_backend("native"):
        patched = clone(**inputs).sample
        clone._flux2_fused_handle.disable()
        expected = clone(**inputs).sample
    assert torch.equal(patched, expected)


def test_enable_on_an_already_wrapped_model_takes_diffusers_forward():
    reference = diffusers_model(Flux2Transformer.random(TINY, seed=5))
    _wrap_a_linear(reference)
    handle = enable(reference)  # no "Missing key(s)" error
    assert handle.model is None
    inputs = _inputs(TINY, "cpu", torch.float32)
    with torch.inference_mode(), attention_backend("native"):
        patched = reference(**inputs).sample
        handle.disable()
        expected = reference(**inputs).sample
    assert torch.equal(patched, expected)
