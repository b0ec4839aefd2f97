"""diffusers' real FLUX.2 pipelines with `enable(pipe)`: tiny random components, prompt embeddings given
(no text encoder), latents equal to the pipeline without the patch, and the patched loop in use."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.bench.hosts import diffusers_model
from flux2_fused.integrations.diffusers import enable
from flux2_fused.models.flux2 import Flux2Config, Flux2Transformer

from ...conftest import count_block_code
from ...models.flux2.test_model import TINY

pipelines = pytest.importorskip("diffusers")
attention_backend = pytest.importorskip("diffusers.models.attention_dispatch").attention_backend


def _vae() -> torch.nn.Module:
    torch.manual_seed(0)
    return pipelines.AutoencoderKLFlux2(
        block_out_channels=(32, 32),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=8,
        norm_num_groups=8,
        layers_per_block=1,
    )


def _pipeline(cls: type, config: Flux2Config = TINY) -> object:
    transformer = diffusers_model(Flux2Transformer.random(config, seed=1))
    scheduler = pipelines.FlowMatchEulerDiscreteScheduler()
    return cls(scheduler=scheduler, vae=_vae(), text_encoder=None, tokenizer=None, transformer=transformer)


def _run(pipe: object, **kwargs: object) -> torch.Tensor:
    embeddings = torch.randn(1, 12, TINY.joint_attention_dim, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode(), attention_backend("native"):
        settings = {"height": 64, "width": 64, "num_inference_steps": 2, **kwargs}
        return pipe(
            prompt_embeds=embeddings, generator=torch.Generator().manual_seed(0), output_type="pt", **settings
        ).images


def _compare(pipe: object, monkeypatch: pytest.MonkeyPatch, **kwargs: object) -> int:
    """Latents with and without the patch are equal; returns how often the patched loop ran a block."""
    calls = count_block_code(monkeypatch, "double_block_body")
    expected = _run(pipe, **kwargs)
    handle = enable(pipe)
    patched = _run(pipe, **kwargs)
    handle.disable()
    assert torch.equal(patched, expected)
    return len(calls)


def test_klein_pipeline_with_cfg(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = _pipeline(pipelines.Flux2KleinPipeline)
    negative = torch.zeros(1, 12, TINY.joint_attention_dim)
    assert _compare(pipe, monkeypatch, negative_prompt_embeds=negative, guidance_scale=4.0) > 0


def test_flux2_pipeline_with_an_input_image(monkeypatch: pytest.MonkeyPatch) -> None:
    """The input image's latents join the image tokens as reference tokens with their own ids."""
    from PIL import Image

    pipe = _pipeline(pipelines.Flux2Pipeline)
    pixels = torch.randint(0, 256, (64, 64, 3), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    image = Image.fromarray(pixels.numpy())
    assert _compare(pipe, monkeypatch, image=[image], guidance_scale=4.0) > 0


def test_klein_kv_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reference-image editing with a KV cache: the first step extracts the reference rows' K/V
    (per-token modulation blending reference and image rows), the others inject them. Each block
    runs the block code around diffusers' KV attention; the latents equal the pipeline alone."""
    from PIL import Image

    pipe = _pipeline(pipelines.Flux2KleinKVPipeline)
    pixels = torch.randint(0, 256, (64, 64, 3), generator=torch.Generator().manual_seed(6), dtype=torch.uint8)
    assert _compare(pipe, monkeypatch, image=[Image.fromarray(pixels.numpy())]) == 2 * TINY.num_layers


def test_klein_inpaint_pipeline_with_cfg(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inpainting: the image's latents noised to the first timestep, the masked area denoised and the
    rest put back from the image after every step; CFG with negative embeddings."""
    from PIL import Image

    pipe = _pipeline(pipelines.Flux2KleinInpaintPipeline)
    gen = torch.Generator().manual_seed(7)
    pixels = torch.randint(0, 256, (64, 64, 3), generator=gen, dtype=torch.uint8)
    mask = (torch.rand(64, 64, generator=gen) > 0.5).to(torch.uint8) * 255
    negative = torch.zeros(1, 12, TINY.joint_attention_dim)
    kwargs = {"image": Image.fromarray(pixels.numpy()), "mask_image": Image.fromarray(mask.numpy())}
    calls = _compare(
        pipe, monkeypatch, **kwargs, strength=1.0, negative_prompt_embeds=negative, guidance_scale=4.0
    )
    assert calls == 2 * 2 * TINY.num_layers  # two steps, each with the prompt and the negative prompt


@pytest.mark.parametrize("before", [True, False], ids=["load-then-enable", "enable-then-load"])
def test_pipeline_load_lora_weights_from_a_file(
    before: bool, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LoRA saved with the pipeline's `save_lora_weights` and loaded with `load_lora_weights`, the
    patch enabled before or after: images equal to the pipeline alone, the adapter acting."""
    peft = pytest.importorskip("peft")
    from peft.utils import get_peft_model_state_dict

    source = _pipeline(pipelines.Flux2KleinPipeline)
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=4, lora_alpha=4, init_lora_weights=False, target_modules=["to_q", "to_qkv_mlp_proj"]
    )
    source.transformer.add_adapter(config)
    type(source).save_lora_weights(
        tmp_path, transformer_lora_layers=get_peft_model_state_dict(source.transformer)
    )

    pipe = _pipeline(pipelines.Flux2KleinPipeline)
    cfg = {"negative_prompt_embeds": torch.zeros(1, 12, TINY.joint_attention_dim), "guidance_scale": 4.0}
    base = _run(pipe, **cfg)
    handle = enable(pipe) if not before else None
    pipe.load_lora_weights(tmp_path)
    if handle is not None:
        handle.disable()
    assert _compare(pipe, monkeypatch, **cfg) > 0
    assert not torch.equal(_run(pipe, **cfg), base)
