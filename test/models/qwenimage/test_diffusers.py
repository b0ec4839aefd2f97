"""The Qwen-Image family on diffusers' QwenImageTransformer2DModel (tiny, CPU): `enable()` reproduces
diffusers' forward bit for bit (text padding masks, guidance-free and masked calls, batch 1 and 2,
fp32/bf16/fp16, ControlNet residuals, a LoRA scale, positional arguments), runs every block through
the family's block code (counted; with the norm's guards forced to accept, its fused branches), and
leaves what it does not implement (zero-timestep conditioning, hooked blocks, other attention
arguments) to diffusers' own code."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from flux2_fused.integrations.diffusers import enable
from flux2_fused.ops import bits_equal

from ...conftest import compiled_targets, count_block_code
from . import support

pytest.importorskip("diffusers.models.transformers.transformer_qwenimage")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _compare(
    model: nn.Module, inputs: dict[str, Any], monkeypatch: pytest.MonkeyPatch, call: Callable | None = None
) -> int:
    """diffusers' output and enable()'s are equal bit for bit; returns how many block bodies ran in the
    patched call."""
    call = call or (lambda: model(**inputs))
    bodies = count_block_code(monkeypatch, "double_block_body", support.FAMILY)
    with torch.inference_mode():
        expected = call()
        handle = enable(model)
        try:
            patched = call()
        finally:
            handle.disable()
    expected, patched = (out.sample if hasattr(out, "sample") else out[0] for out in (expected, patched))
    assert bits_equal(patched, expected)
    return len(bodies)


@pytest.mark.parametrize("padded", [0, 2], ids=["no-padding", "padded-text"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_is_diffusers_bit_for_bit(
    dtype: torch.dtype, batch: int, padded: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = support.transformer().to(dtype)
    inputs = support.step_inputs(batch=batch, dtype=dtype, padded=padded if batch == 2 else 0)
    assert _compare(model, inputs, monkeypatch) == support.TINY["num_layers"]


def test_without_a_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = support.step_inputs()
    inputs["encoder_hidden_states_mask"] = None
    assert _compare(support.transformer(), inputs, monkeypatch) == support.TINY["num_layers"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_fused_branches_are_diffusers_bit_for_bit(
    dtype: torch.dtype, gated_resnorm_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the norm's guards accepting (its reference as the kernel): each modulated norm one launch,
    the gated residuals pending into the next norm, diffusers' bits."""
    model = support.transformer().to(dtype)
    _compare(model, support.step_inputs(dtype=dtype), monkeypatch)
    # four modulated norms a block, and the output norm
    assert len(gated_resnorm_on_cpu) == 4 * support.TINY["num_layers"] + 1


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_fused_prologue_is_diffusers_bit_for_bit(
    dtype: torch.dtype, batch: int, prologue_on_cpu: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each block's four diffusers RMSNorms and Qwen's complex rotation of both streams as one
    prologue launch ("mean" norm, "complex" rotation, text rows first): diffusers' bits."""
    model = support.transformer().to(dtype)
    inputs = support.step_inputs(batch=batch, dtype=dtype, padded=2 if batch == 2 else 0)
    assert _compare(model, inputs, monkeypatch) == support.TINY["num_layers"]
    assert prologue_on_cpu == [("complex", "mean", 1e-6, 2)] * support.TINY["num_layers"]


def test_a_replaced_rotary_function_runs_in_place_of_the_prologue(
    prologue_on_cpu: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tool that replaces `apply_rotary_emb_qwen` is honored: the prologue does not launch, the
    norms run as module calls and the replacement rotates, as in diffusers' own forward."""
    qwen = __import__("diffusers.models.transformers.transformer_qwenimage", fromlist=["_"])
    original = qwen.apply_rotary_emb_qwen
    calls = []

    def replaced(x, freqs_cis, use_real=True, use_real_unbind_dim=-1):
        calls.append(x.shape)
        return original(x, freqs_cis, use_real, use_real_unbind_dim) * 0.5

    monkeypatch.setattr(qwen, "apply_rotary_emb_qwen", replaced)
    assert _compare(support.transformer(), support.step_inputs(), monkeypatch) == support.TINY["num_layers"]
    assert prologue_on_cpu == []
    assert len(calls) == 2 * 4 * support.TINY["num_layers"]  # diffusers' call, then the block code's


def test_qk_norms_of_another_arithmetic_run_as_module_calls(
    prologue_on_cpu: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q/k norms the host does not vouch for as diffusers' plain `RMSNorm` (one with a bias, one
    hooked): that block's module calls and diffusers' rotation, diffusers' bits."""
    model = support.transformer().to(torch.bfloat16)
    attn = model.transformer_blocks[0].attn
    attn.norm_q.bias = nn.Parameter(torch.zeros_like(attn.norm_q.weight))
    model.transformer_blocks[1].attn.norm_k.register_forward_hook(lambda *_: None)
    _compare(model, support.step_inputs(dtype=torch.bfloat16), monkeypatch)
    assert prologue_on_cpu == []


def test_fp16_clips_both_streams_where_diffusers_clips(monkeypatch: pytest.MonkeyPatch) -> None:
    model = support.transformer().half()
    inputs = support.step_inputs(dtype=torch.float16)
    inputs["hidden_states"] = inputs["hidden_states"] * 3e4
    inputs["encoder_hidden_states"] = inputs["encoder_hidden_states"] * 3e4
    _compare(model, inputs, monkeypatch)


def test_controlnet_residuals_lora_scale_and_positional_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    model = support.transformer()
    inputs = support.step_inputs()
    gen = torch.Generator().manual_seed(5)
    samples = [torch.randn((*inputs["hidden_states"].shape[:2], 32), generator=gen)]
    inputs.update(controlnet_block_samples=samples, attention_kwargs={"scale": 0.5})
    assert _compare(model, inputs, monkeypatch) == support.TINY["num_layers"]
    names = ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep", "img_shapes")
    args = tuple(inputs[name] for name in names)
    rest = {k: v for k, v in inputs.items() if k not in names}
    assert (
        _compare(model, inputs, monkeypatch, call=lambda: model(*args, **rest)) == support.TINY["num_layers"]
    )


def test_zero_timestep_conditioning_runs_diffusers_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The edit models' per-token modulation (`zero_cond_t`) is diffusers' own forward."""
    model = support.transformer(zero_cond_t=True)
    inputs = support.step_inputs(batch=1, padded=0)
    inputs["img_shapes"] = [[(1, 3, 5)]]
    assert _compare(model, inputs, monkeypatch) == 0


def test_a_hooked_block_runs_its_fused_forward_under_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block with a forward hook is called as a module (the hook sees real tensors), and its forward
    is the block code's."""
    model = support.transformer()
    seen = []
    model.transformer_blocks[1].register_forward_hook(lambda module, args, out: seen.append(out))
    assert _compare(model, support.step_inputs(), monkeypatch) == support.TINY["num_layers"]
    assert len(seen) == 2 and all(isinstance(t, torch.Tensor) for t in seen[1])  # diffusers' call, ours


@pytest.mark.parametrize("cache", ["first-block", "taylorseer"])
def test_diffusers_caches_in_either_order(cache: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """diffusers' FirstBlockCache and TaylorSeer on the transformer, before or after enable(): the
    pipeline's images are the cache's alone, and the blocks the cache runs run the block code."""
    from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig

    configs = {
        "first-block": lambda: FirstBlockCacheConfig(threshold=0.3),
        "taylorseer": lambda: TaylorSeerCacheConfig(cache_interval=2, max_order=1),
    }
    embeds = torch.randn(
        1, 7, support.TINY["joint_attention_dim"], generator=torch.Generator().manual_seed(0)
    )
    bodies = count_block_code(monkeypatch, "double_block_body", support.FAMILY)
    images = {}
    for order in ("alone", "enable-then-cache", "cache-then-enable"):
        pipe = support.pipeline(support.transformer(num_layers=4))
        handle = enable(pipe) if order == "enable-then-cache" else None
        pipe.transformer.enable_cache(configs[cache]())
        handle = enable(pipe) if order == "cache-then-enable" else handle
        with torch.inference_mode():
            images[order] = pipe(
                prompt_embeds=embeds,
                prompt_embeds_mask=torch.ones(1, 7, dtype=torch.long),
                num_inference_steps=6,
                height=32,
                width=32,
                generator=torch.Generator().manual_seed(1),
                output_type="pt",
            ).images
        runs = len(bodies)
        bodies.clear()
        assert (runs > 0) == (handle is not None)
    assert all(torch.equal(image, images["alone"]) for image in images.values())


def test_other_attention_arguments_run_the_attention_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """An attention argument the block code does not implement reaches the attention module's own
    call, which handles it as diffusers does (here: drops it with diffusers' warning)."""
    inputs = support.step_inputs()
    inputs["attention_kwargs"] = {"unused_option": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _compare(support.transformer(), inputs, monkeypatch) == support.TINY["num_layers"]


def test_a_cache_calls_the_blocks_fused_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller other than the loop (diffusers' block hooks, caches) gets the block's forward on the
    block code: diffusers' arguments, (text, image) back, equal bits."""
    model = support.transformer()
    inputs = support.step_inputs()
    block = model.transformer_blocks[0]
    with torch.inference_mode():
        x = model.img_in(inputs["hidden_states"])
        c = model.txt_in(model.txt_norm(inputs["encoder_hidden_states"]))
        temb = model.time_text_embed(inputs["timestep"], x)
        rotary = model.pos_embed(inputs["img_shapes"], max_txt_seq_len=c.shape[1], device=x.device)
        kwargs = {
            "hidden_states": x,
            "encoder_hidden_states": c,
            "encoder_hidden_states_mask": inputs["encoder_hidden_states_mask"].bool(),
            "temb": temb,
            "image_rotary_emb": rotary,
        }
        expected = block(**kwargs)
        bodies = count_block_code(monkeypatch, "double_block_body", support.FAMILY)
        handle = enable(model)
        try:
            patched = block(**kwargs)
        finally:
            handle.disable()
    assert len(bodies) == 1
    assert all(bits_equal(a, b) for a, b in zip(patched, expected, strict=True))


@pytest.mark.parametrize("offload_type", ["leaf_level", "block_level"])
def test_group_offload(offload_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """diffusers' group offloading (CPU to CPU here) wraps what it moves: the block code calls the
    wrapped Linears and norms as modules, and a block wrapped whole runs its fused forward under the
    offload hooks."""
    model = support.transformer()
    cpu = torch.device("cpu")
    kwargs = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
    model.enable_group_offload(onload_device=cpu, offload_device=cpu, offload_type=offload_type, **kwargs)
    assert _compare(model, support.step_inputs(), monkeypatch) == support.TINY["num_layers"]


def test_torch_compile_of_the_patched_transformer() -> None:
    """torch.compile traces the patched forward: the fused sites become flux2_fused operators, and the
    output is diffusers'."""
    model = support.transformer()
    inputs = support.step_inputs()
    with torch.inference_mode():
        expected = model(**inputs).sample
        handle = enable(model)
        try:
            compiled, targets = compiled_targets(
                model, lambda compiled_model: compiled_model(**inputs).sample
            )
        finally:
            handle.disable()
    assert {torch.ops.flux2_fused.gated_resnorm.default, torch.ops.flux2_fused.gelu_tanh.default} <= targets
    assert torch.equal(compiled, expected)


def test_fused_projections_run_diffusers_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """`fuse_projections()` adds fused q/k/v Linears that Qwen's processor never uses (it keeps the
    separate ones): the blocks then run diffusers' own code, with its bits."""
    model = support.transformer()
    for block in model.transformer_blocks:
        block.attn.fuse_projections()
    assert _compare(model, support.step_inputs(), monkeypatch) == 0
