"""The FLUX.1 family on diffusers' FluxTransformer2DModel (tiny, CPU): `enable()` reproduces diffusers'
forward bit for bit for every argument that changes the block math (ControlNet residuals, an
IP-Adapter, LoRA scales, 3-D ids, positional arguments), runs the blocks through the family's block
code (counted), leaves hooked or refitted modules to their own calls, and runs in the FLUX.1
pipelines (text-to-image, image-to-image, inpainting, Fill, Kontext, ControlNet)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from flux2_fused.integrations.diffusers import enable
from flux2_fused.ops import bits_equal

from ...conftest import count_block_code
from . import support

diffusers = pytest.importorskip("diffusers")
transformer_flux = pytest.importorskip("diffusers.models.transformers.transformer_flux")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bodies(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Counters of the double and single block bodies of FLUX.1's block code."""
    return [
        count_block_code(monkeypatch, f"{kind}_block_body", support.FAMILY) for kind in ("double", "single")
    ]


def _compare(
    model: nn.Module, inputs: dict[str, Any], monkeypatch: pytest.MonkeyPatch, call: Callable | None = None
) -> tuple[int, int]:
    """diffusers' output and enable()'s are equal bit for bit (NaN where diffusers has NaN); returns how many
    double and single block bodies ran in the patched call."""
    call = call or (lambda: model(**inputs))
    double, single = _bodies(monkeypatch)
    with torch.inference_mode():
        expected = call()
        handle = enable(model)
        try:
            patched = call()
        finally:
            handle.disable()
    expected, patched = (out.sample if hasattr(out, "sample") else out[0] for out in (expected, patched))
    assert bits_equal(patched, expected)
    return len(double), len(single)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_is_diffusers_bit_for_bit(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    model = support.transformer().to(dtype)
    inputs = support.step_inputs(dtype=dtype)
    assert _compare(model, inputs, monkeypatch) == (
        support.TINY["num_layers"],
        support.TINY["num_single_layers"],
    )


def test_fp16_clips_where_diffusers_clips(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs large enough that fp16 streams saturate: the clips happen where diffusers' do."""
    model = support.transformer().half()
    inputs = support.step_inputs(dtype=torch.float16)
    inputs["hidden_states"] = inputs["hidden_states"] * 1e4
    inputs["encoder_hidden_states"] = inputs["encoder_hidden_states"] * 1e4
    _compare(model, inputs, monkeypatch)


def test_positional_arguments_and_tuples(monkeypatch: pytest.MonkeyPatch) -> None:
    model = support.transformer()
    inputs = support.step_inputs()
    args = tuple(inputs[name] for name in ("hidden_states", "encoder_hidden_states", "pooled_projections"))
    rest = {
        k: v
        for k, v in inputs.items()
        if k not in ("hidden_states", "encoder_hidden_states", "pooled_projections")
    }
    assert _compare(model, inputs, monkeypatch, lambda: model(*args, **rest, return_dict=False))[0] > 0


def test_schnell_without_guidance(monkeypatch: pytest.MonkeyPatch) -> None:
    model = support.transformer(guidance_embeds=False)
    inputs = {**support.step_inputs(), "guidance": None}
    assert _compare(model, inputs, monkeypatch)[0] > 0


def test_3d_ids_are_taken_as_diffusers_takes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deprecated batched ids: diffusers warns and uses the first; so does the fused forward."""
    model = support.transformer()
    inputs = support.step_inputs()
    inputs["img_ids"] = inputs["img_ids"][None].repeat(2, 1, 1)
    inputs["txt_ids"] = inputs["txt_ids"][None].repeat(2, 1, 1)
    assert _compare(model, inputs, monkeypatch)[0] > 0


def test_a_call_diffusers_rejects_raises_diffusers_error() -> None:
    model = support.transformer()
    inputs = {k: v for k, v in support.step_inputs().items() if k != "img_ids"}
    enable(model)
    with pytest.raises(AttributeError):  # diffusers' own forward: `None.ndim`
        model(**inputs)


@pytest.mark.parametrize("repeat", [False, True], ids=["interval", "repeat"])
def test_controlnet_residuals(repeat: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """ControlNet samples added after each double block (by interval, or repeated as XLabs' are) and
    each single block: the streams they are added to are materialized first, as diffusers adds them."""
    model = support.transformer()
    inputs = support.step_inputs()
    gen = torch.Generator().manual_seed(9)
    rows = (*inputs["hidden_states"].shape[:2], model.inner_dim)  # the image stream's shape
    samples = [torch.randn(rows, generator=gen)]
    singles = [torch.randn(rows, generator=gen) for _ in range(2)]
    inputs.update(
        controlnet_block_samples=samples,
        controlnet_single_block_samples=singles,
        controlnet_blocks_repeat=repeat,
    )
    assert _compare(model, inputs, monkeypatch) == (
        support.TINY["num_layers"],
        support.TINY["num_single_layers"],
    )


def _with_ip_adapter(model: nn.Module, tokens: int = 3) -> None:
    """An IP-Adapter as diffusers loads one on FLUX.1: an image projection on the model, the
    IP-Adapter processor in each double block (single blocks keep the default processor)."""
    from diffusers.models.embeddings import ImageProjection, MultiIPAdapterImageProjection

    torch.manual_seed(4)
    dim = model.inner_dim
    model.encoder_hid_proj = MultiIPAdapterImageProjection(
        [ImageProjection(image_embed_dim=10, cross_attention_dim=dim, num_image_text_embeds=tokens)]
    )
    for block in model.transformer_blocks:
        block.attn.set_processor(
            transformer_flux.FluxIPAdapterAttnProcessor(dim, dim, num_tokens=(tokens,), scale=0.6)
        )


def test_ip_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ip_adapter_image_embeds` projected into `ip_hidden_states` by the model; the double blocks'
    IP-Adapter attention runs as a module call inside the fused block (its image update added after
    the feed-forward's), the single blocks' default attention drops the IP arguments, as diffusers'."""
    model = support.transformer()
    _with_ip_adapter(model)
    inputs = support.step_inputs()
    embeds = torch.randn(2, 1, 10, generator=torch.Generator().manual_seed(2))
    given = {"ip_adapter_image_embeds": [embeds]}
    call = lambda: model(**inputs, joint_attention_kwargs=dict(given))  # noqa: E731 - diffusers pops from it
    assert _compare(model, inputs, monkeypatch, call) == (
        support.TINY["num_layers"],
        support.TINY["num_single_layers"],
    )


def test_lora_scale_and_two_adapters(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two peft adapters weighted by `set_adapters`, scaled per call by joint_attention_kwargs["scale"]
    as diffusers' `apply_lora_scale` does, then fused into the weights."""
    peft = pytest.importorskip("peft")
    from flux2_fused.bench import flux1, hosts

    model = support.transformer()
    for seed, name in ((1, "a"), (2, "b")):
        hosts.add_lora(model, 4, name, seed=seed, targets=flux1.LORA_TARGETS)
    model.set_adapters(["a", "b"], [0.7, 0.4])
    assert any(
        isinstance(m, peft.tuners.lora.LoraLayer) for m in model.single_transformer_blocks[0].modules()
    )
    inputs = support.step_inputs()
    scaled = lambda: model(**inputs, joint_attention_kwargs={"scale": 0.5})  # noqa: E731
    assert _compare(model, inputs, monkeypatch, scaled)[0] > 0
    model.fuse_lora()
    assert _compare(model, inputs, monkeypatch)[0] > 0


def test_hooked_and_refitted_modules_run_as_module_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward hook on a double block (its own call, under the hook: still the block code), a
    pre-hook on a feed-forward and a single block's fused QKV projections (diffusers'
    `fuse_projections`): those modules run their own calls, the output stays diffusers'."""
    model = support.transformer()
    seen: list[str] = []
    model.transformer_blocks[0].register_forward_hook(lambda m, a, o: seen.append("block"))
    model.transformer_blocks[1].ff.register_forward_pre_hook(lambda m, a: seen.append("ff"))
    model.single_transformer_blocks[0].attn.fuse_projections()
    _compare(model, support.step_inputs(), monkeypatch)
    assert seen.count("block") == 2 and seen.count("ff") == 2


def _joint_output(block: nn.Module, *args: Any) -> tuple[torch.Tensor]:
    """A block's (text, image) output as one tensor, in a tuple as `_compare` reads outputs."""
    return (torch.cat(block(*args), dim=1),)


def test_a_block_called_on_its_own_runs_the_block_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block called by something other than the loop (a cache, a hook) runs its fused forward and
    returns diffusers' (text, image) tensors."""
    model = support.transformer()
    inputs = support.step_inputs()
    with torch.inference_mode():
        temb = model.time_text_embed(
            inputs["timestep"] * 1000, inputs["guidance"] * 1000, inputs["pooled_projections"]
        )
        rope = model.pos_embed(torch.cat([inputs["txt_ids"], inputs["img_ids"]]))
    x = model.x_embedder(inputs["hidden_states"]).detach()
    c = model.context_embedder(inputs["encoder_hidden_states"]).detach()
    for block in (model.transformer_blocks[0], model.single_transformer_blocks[0]):
        call = functools.partial(_joint_output, block, x, c, temb, rope)
        double, single = _compare(model, {}, monkeypatch, call)
        assert double + single == 1


PIPELINES = {
    "FluxPipeline": lambda: (support.pipeline(diffusers.FluxPipeline), {}),
    "FluxImg2ImgPipeline": lambda: (
        support.pipeline(diffusers.FluxImg2ImgPipeline),
        {"image": support.image(), "strength": 0.9},
    ),
    "FluxInpaintPipeline": lambda: (
        support.pipeline(diffusers.FluxInpaintPipeline),
        {"image": support.image(), "mask_image": support.image(seed=7), "strength": 0.9},
    ),
    # Fill: the masked image's latents and the mask join the 16 latent channels (16 + 16 + 16).
    "FluxFillPipeline": lambda: (
        support.pipeline(diffusers.FluxFillPipeline, support.transformer(in_channels=48, out_channels=16)),
        {"image": support.image(), "mask_image": support.image(seed=7)},
    ),
    "FluxKontextPipeline": lambda: (
        support.pipeline(diffusers.FluxKontextPipeline),
        {"image": support.image(), "max_area": 32 * 32, "_auto_resize": False},
    ),
    "FluxControlNetPipeline": lambda: (
        support.pipeline(diffusers.FluxControlNetPipeline, controlnet=support.controlnet()),
        {"control_image": support.image(), "controlnet_conditioning_scale": 0.8},
    ),
}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_pipelines(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each FLUX.1 pipeline of tiny random components: the same image with and without enable(),
    every block of every step through the block code."""
    pipe, kwargs = PIPELINES[name]()
    double, single = _bodies(monkeypatch)
    expected = support.run(pipe, **kwargs)
    handle = enable(pipe)
    patched = support.run(pipe, **kwargs)
    handle.disable()
    assert torch.equal(patched, expected)
    assert len(double) + len(single) == 2 * support.BLOCKS


def test_pipeline_load_lora_weights_from_a_file(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A LoRA saved by FluxPipeline.save_lora_weights and loaded into another pipeline, enabled
    before and after the load."""
    pytest.importorskip("peft")
    from peft.utils import get_peft_model_state_dict

    from flux2_fused.bench import flux1, hosts

    source = support.transformer()
    hosts.add_lora(source, 4, seed=3, targets=flux1.LORA_TARGETS)
    diffusers.FluxPipeline.save_lora_weights(
        tmp_path, transformer_lora_layers=get_peft_model_state_dict(source)
    )
    images = []
    for enable_first in (None, False, True):
        pipe = support.pipeline(diffusers.FluxPipeline)
        handle = enable(pipe) if enable_first else None
        pipe.load_lora_weights(tmp_path)
        handle = enable(pipe) if enable_first is False else handle
        images.append(support.run(pipe, joint_attention_kwargs={"scale": 0.5}))
        if handle is not None:
            handle.disable()
    assert torch.equal(images[1], images[0]) and torch.equal(images[2], images[0])


def test_chroma_is_refused_with_what_it_lacks() -> None:
    """Chroma's transformer has blocks of its own (modulation read from a per-block slice of its
    approximator's output, attention masks): not this family, so enable() refuses it."""
    chroma = pytest.importorskip("diffusers.models.transformers.transformer_chroma")
    model = chroma.ChromaTransformer2DModel(
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=24,
        in_channels=16,
        axes_dims_rope=(4, 6, 6),
        approximator_num_channels=8,
        approximator_hidden_dim=16,
        approximator_layers=1,
    )
    with pytest.raises(TypeError, match="FluxTransformer2DModel"):
        enable(model)
