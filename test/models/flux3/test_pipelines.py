"""diffusers' FLUX.3 modular pipelines with `enable(pipe)`: `Flux3ModularPipeline` (`Flux3AutoBlocks`,
classifier-free guidance through its guider) and `Flux3DistilledModularPipeline`
(`Flux3DistilledAutoBlocks`, the flow-map transformer given the timestep each step jumps to), built from
tiny random components on the CPU, with nothing downloaded. Latents and images equal the pipeline
alone bit for bit, with every transformer call through the family's block code.

The pipelines are the benchmarks' (`bench.flux3.pipeline`): no text encoder (the blocks' prompt
upsampler and Qwen3-VL text encoder steps are popped: the upsampler's own docstring says to pop it to
encode a prompt as given; the text encoder step runs unconditionally and would need a Qwen3-VL model
and its processor files), so `prompt_embeds` (and `negative_prompt_embeds` for CFG) become pipeline
inputs, as diffusers' text encoder step would have produced them; a random VAE with the real one's
four levels, 16 channels each. Every other step is diffusers' own: the reference image's
preprocessing and VAE encoding, the latents, timesteps, RoPE ids, the denoise loop, and the VAE
decode."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flux2_fused.bench import flux3
from flux2_fused.integrations.diffusers import enable

from ...conftest import count_block_code
from . import support

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("diffusers.modular_pipelines.flux3")
pytest.importorskip("transformers")  # the FLUX.3 modular pipelines' classes need it

STEPS = support.PIPELINE_STEPS
LAYERS = support.TINY["num_layers"]
SINGLE_LAYERS = support.TINY["num_single_layers"]


def _pipeline(distilled: bool = False) -> Any:
    """The pipeline around the tiny transformer (the flow map for `distilled`); the scheduler (shift
    6.93), the image processor and, for the base model, the CFG guider (scale 3.5) are the blocks' own
    defaults."""
    return flux3.pipeline(support.transformer(flow_map=distilled))


def _embeddings(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(
        1, tokens, support.TINY["joint_attention_dim"], generator=torch.Generator().manual_seed(seed)
    )


def _compare(pipe: Any, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> tuple[torch.Tensor, int, int]:
    """The pipeline alone, then with enable(pipe): equal latents and images. Returns the images and
    how often the mode and single blocks ran the block code."""
    expected = support.run_pipeline(pipe, **kwargs)
    handle = enable(pipe)
    mode = count_block_code(monkeypatch, "mode_block_body", support.FAMILY)
    single = count_block_code(monkeypatch, "single_block_body", support.FAMILY)
    patched = support.run_pipeline(pipe, **kwargs)
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
    images, mode, single = _compare(pipe, monkeypatch, image=support.reference_image(), **embeddings)
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
    kwargs = {"image": support.reference_image()} if reference else {"height": 32, "width": 32}
    _, mode, single = _compare(pipe, monkeypatch, prompt_embeds=_embeddings(7, seed=3), **kwargs)
    modes = 3 if reference else 2
    assert mode == STEPS * modes * LAYERS and single == STEPS * SINGLE_LAYERS
    assert len(targets) == 2 * STEPS  # the pipeline alone, then patched
    jumps = torch.cat([pipe.scheduler.timesteps[1:] / 1000, torch.zeros(1)])
    for run in (targets[:STEPS], targets[STEPS:]):
        assert torch.equal(torch.cat(run), jumps) and jumps[0] > 0
