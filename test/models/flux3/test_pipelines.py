"""diffusers' FLUX.3 modular pipelines with `enable(pipe)`: `Flux3ModularPipeline` (`Flux3AutoBlocks`,
classifier-free guidance through its guider) and `Flux3DistilledModularPipeline`
(`Flux3DistilledAutoBlocks`, the flow-map transformer given the timestep each step jumps to), built from
tiny random components on the CPU, with nothing downloaded. Latents and images equal the pipeline
alone bit for bit, with every transformer call through the family's block code.

No text encoder: the blocks' prompt upsampler and Qwen3-VL text encoder steps are popped (the
upsampler's own docstring says to pop it to encode a prompt as given; the text encoder step runs
unconditionally and would need a Qwen3-VL model and its processor files), so `prompt_embeds` (and
`negative_prompt_embeds` for CFG) become pipeline inputs, as diffusers' text encoder step would have
produced them. Every other step is diffusers' own: the reference image's preprocessing and VAE
encoding, the latents, timesteps, RoPE ids, the denoise loop, and the VAE decode."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flux2_fused.integrations.diffusers import enable

from ...conftest import count_block_code
from . import support

diffusers = pytest.importorskip("diffusers")
flux3_modular = pytest.importorskip("diffusers.modular_pipelines.flux3")
attention_backend = pytest.importorskip("diffusers.models.attention_dispatch").attention_backend

STEPS = 2
LAYERS = support.TINY["num_layers"]
SINGLE_LAYERS = support.TINY["num_single_layers"]


def _vae() -> torch.nn.Module:
    """A random AutoencoderKLFlux2 (the class the FLUX.3 VAE steps expect) with the real model's four
    levels, so 8x downsampling and 16-pixel tokens as the default `Flux3ImageProcessor` assumes, but
    16 channels a level; 4 latent channels, packed 2x2 into the transformer's 16 input channels."""
    torch.manual_seed(0)
    return diffusers.AutoencoderKLFlux2(
        block_out_channels=(16,) * 4,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=support.TINY["in_channels"] // 4,
        norm_num_groups=8,
        layers_per_block=1,
    ).eval()


def _pipeline(distilled: bool = False) -> Any:
    """The modular pipeline around the tiny transformer (the flow map for `distilled`) and VAE, its
    auto blocks without the prompt upsampler and the text encoder; the scheduler (shift 6.93), the
    image processor and, for the base model, the CFG guider (scale 3.5) are the blocks' own defaults."""
    if distilled:
        blocks, cls = flux3_modular.Flux3DistilledAutoBlocks(), flux3_modular.Flux3DistilledModularPipeline
    else:
        blocks, cls = flux3_modular.Flux3AutoBlocks(), flux3_modular.Flux3ModularPipeline
    for name in ("prompt_upsampler", "text_encoder"):
        blocks.sub_blocks.pop(name)
    pipe = cls(blocks=blocks)
    pipe.update_components(transformer=support.transformer(flow_map=distilled), vae=_vae())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _embeddings(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(
        1, tokens, support.TINY["joint_attention_dim"], generator=torch.Generator().manual_seed(seed)
    )


def _reference() -> Any:
    """A random 48 x 40 RGB image: padded to its 64 x 64 canvas (4 x 4 tokens) by the preprocess step."""
    from PIL import Image

    pixels = torch.randint(0, 256, (40, 48, 3), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def _run(pipe: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
    settings = {"num_inference_steps": STEPS, "output_type": "pt", **kwargs}
    with torch.inference_mode(), attention_backend("native"):
        return pipe(generator=torch.Generator().manual_seed(0), output=["latents", "images"], **settings)


def _compare(pipe: Any, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> tuple[torch.Tensor, int, int]:
    """The pipeline alone, then with enable(pipe): equal latents and images. Returns the images and
    how often the mode and single blocks ran the block code."""
    expected = _run(pipe, **kwargs)
    handle = enable(pipe)
    mode = count_block_code(monkeypatch, "mode_block_body", support.FAMILY)
    single = count_block_code(monkeypatch, "single_block_body", support.FAMILY)
    patched = _run(pipe, **kwargs)
    handle.disable()
    for name in ("latents", "images"):
        assert torch.equal(patched[name], expected[name]), name
    return patched["images"], len(mode), len(single)


def test_text_to_image_with_cfg(monkeypatch: pytest.MonkeyPatch) -> None:
    """32 x 32 (2 x 2 tokens), two steps, each with the prompt and the negative prompt (two passes)."""
    pipe = _pipeline()
    assert isinstance(pipe.guider, diffusers.ClassifierFreeGuidance) and pipe.requires_unconditional_embeds
    embeddings = {"prompt_embeds": _embeddings(7, seed=3), "negative_prompt_embeds": _embeddings(5, seed=4)}
    images, mode, single = _compare(pipe, monkeypatch, height=32, width=32, **embeddings)
    assert images.shape == (1, 3, 32, 32)
    calls = STEPS * 2
    assert mode == calls * 2 * LAYERS and single == calls * SINGLE_LAYERS


def test_image_to_image_with_a_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """One reference image: VAE-encoded and passed as `image_cond_hidden_states` (a third mode per
    block); the generation takes the reference's canvas and the decode crops back to its size."""
    pipe = _pipeline()
    embeddings = {"prompt_embeds": _embeddings(7, seed=3), "negative_prompt_embeds": _embeddings(5, seed=4)}
    images, mode, single = _compare(pipe, monkeypatch, image=_reference(), **embeddings)
    assert images.shape == (1, 3, 40, 48)
    calls = STEPS * 2
    assert mode == calls * 3 * LAYERS and single == calls * SINGLE_LAYERS


@pytest.mark.parametrize("reference", [False, True], ids=["text-to-image", "image-to-image"])
def test_distilled_flow_map(reference: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step-distilled pipeline: one pass a step, no guider, each call given `target_timestep` (the
    next timestep, 0 after the last)."""
    pipe = _pipeline(distilled=True)
    assert getattr(pipe, "guider", None) is None
    targets: list[torch.Tensor] = []

    def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        targets.append(kwargs["target_timestep"].clone())

    pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
    kwargs = {"image": _reference()} if reference else {"height": 32, "width": 32}
    _, mode, single = _compare(pipe, monkeypatch, prompt_embeds=_embeddings(7, seed=3), **kwargs)
    modes = 3 if reference else 2
    assert mode == STEPS * modes * LAYERS and single == STEPS * SINGLE_LAYERS
    assert len(targets) == 2 * STEPS  # the pipeline alone, then patched
    jumps = torch.cat([pipe.scheduler.timesteps[1:] / 1000, torch.zeros(1)])
    for run in (targets[:STEPS], targets[STEPS:]):
        assert torch.equal(torch.cat(run), jumps) and jumps[0] > 0
