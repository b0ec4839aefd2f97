"""FLUX.3 on diffusers' own modules: `enable()` on a tiny `Flux3Transformer2DModel` gives diffusers'
output bit for bit, with every block through the family's block code (on the CPU the ops run their
eager chains; the GPU tests check the kernels): text-to-image, reference images, the flow map,
positional arguments, fp16, LoRA, hooks on a block, and calls diffusers rejects."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flux2_fused.integrations.diffusers import enable

from ...conftest import compiled_targets, count_block_code
from . import support

pytest.importorskip("diffusers.models.transformers.transformer_flux3")
attention_backend = pytest.importorskip("diffusers.models.attention_dispatch").attention_backend


def _bodies(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    return [
        count_block_code(monkeypatch, f"{kind}_block_body", support.FAMILY) for kind in ("mode", "single")
    ]


def _run(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    with torch.inference_mode(), attention_backend("native"):
        return model(*args, **kwargs)


def _compare(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, *args: Any, **kwargs: Any) -> None:
    """diffusers' output, then enable()'s with every block through the block code, equal bits."""
    expected = _run(model, *args, **kwargs)
    handle = enable(model)
    mode, single = _bodies(monkeypatch)
    patched = _run(model, *args, **kwargs)
    handle.disable()
    expected, patched = (out[0] if isinstance(out, tuple) else out.sample for out in (expected, patched))
    assert torch.equal(patched, expected)
    modes = 3 if kwargs.get("image_cond_hidden_states") is not None else 2
    assert len(mode) == modes * support.TINY["num_layers"]
    assert len(single) == support.TINY["num_single_layers"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_text_to_image_is_diffusers_bit_for_bit(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    _compare(support.transformer(dtype=dtype), monkeypatch, **support.step_inputs(dtype=dtype))


@pytest.mark.parametrize("batch", [1, 2])
def test_reference_images(batch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = support.step_inputs(batch=batch, references=2, txt_tokens=7)
    _compare(support.transformer(), monkeypatch, **inputs)


def test_flow_map(monkeypatch: pytest.MonkeyPatch) -> None:
    _compare(support.transformer(flow_map=True), monkeypatch, **support.step_inputs(flow_map=True))


def test_positional_arguments_and_tuples(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = support.step_inputs()
    args = [
        inputs[name] for name in ("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids")
    ]
    _compare(support.transformer(), monkeypatch, *args, return_dict=False)


@pytest.mark.parametrize(
    "change",
    [
        {"image_cond_hidden_states": torch.zeros(2, 9, 16)},  # without ids
        {"target_timestep": torch.zeros(2)},  # a model that is no flow map
    ],
    ids=["reference without ids", "target timestep"],
)
def test_a_call_diffusers_rejects_raises_diffusers_error(change: dict) -> None:
    model = support.transformer()
    inputs = {**support.step_inputs(), **change}
    with pytest.raises(ValueError) as expected:
        _run(model, **inputs)
    enable(model)
    with pytest.raises(ValueError) as patched:
        _run(model, **inputs)
    assert str(patched.value) == str(expected.value)


def test_lora_scale_in_attention_kwargs(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("peft")
    from peft import LoraConfig

    model = support.transformer()
    model.add_adapter(
        LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_v", "linear_in"], init_lora_weights=False)
    )
    _compare(model, monkeypatch, **support.step_inputs(), attention_kwargs={"scale": 0.5})


def test_a_hooked_block_runs_its_fused_forward_under_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward hook on a mode block and on a single block: each runs the block code under its hook
    (the hook sees real tensors), the other blocks run it from the loop."""
    model = support.transformer()
    seen = []
    for block in (model.mode_blocks["image"][0], model.single_transformer_blocks[1]):
        block.register_forward_hook(lambda module, args, out: seen.append(type(out)))
    _compare(model, monkeypatch, **support.step_inputs())
    assert len(seen) == 4 and torch.Tensor in seen and tuple in seen


def test_a_block_with_a_foreign_norm_runs_diffusers_call(monkeypatch: pytest.MonkeyPatch) -> None:
    model = support.transformer()
    model.txt_mode_blocks[0].norm.register_forward_pre_hook(lambda module, args: None)
    expected = _run(model, **support.step_inputs()).sample
    handle = enable(model)
    mode, single = _bodies(monkeypatch)
    patched = _run(model, **support.step_inputs()).sample
    handle.disable()
    assert torch.equal(patched, expected)
    assert (
        len(mode) == 2 * support.TINY["num_layers"] - 1 and len(single) == support.TINY["num_single_layers"]
    )


def test_torchao_int8_weight_only_linears(monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantized linears (torchao int8 weight-only, bf16) are called as modules by the block code."""
    torchao = pytest.importorskip("torchao.quantization")
    model = support.transformer(dtype=torch.bfloat16)
    torchao.quantize_(model, torchao.Int8WeightOnlyConfig())
    _compare(model, monkeypatch, **support.step_inputs(dtype=torch.bfloat16))


@pytest.mark.parametrize("offload_type", ["leaf_level", "block_level"])
def test_group_offload(offload_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """diffusers' group offloading (CPU to CPU here) wraps what it moves: the block code calls the
    wrapped Linears and norms as modules, and a block wrapped whole runs its fused forward under the
    offload hooks."""
    model = support.transformer()
    cpu = torch.device("cpu")
    kwargs = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
    model.enable_group_offload(onload_device=cpu, offload_device=cpu, offload_type=offload_type, **kwargs)
    inputs = support.step_inputs()
    expected = _run(model, **inputs).sample
    handle = enable(model)
    patched = _run(model, **inputs).sample
    handle.disable()
    assert torch.equal(patched, expected)


def test_torch_compile_of_the_patched_transformer() -> None:
    """torch.compile traces the patched forward in one graph: the fused sites become flux2_fused
    operators (per-token modulation and two-term updates included), and the output is diffusers'."""
    model = support.transformer()
    inputs = support.step_inputs()
    expected = _run(model, **inputs).sample
    handle = enable(model)
    compiled, targets = compiled_targets(
        model, lambda compiled_model: _run(compiled_model, **inputs).sample, fullgraph=True
    )
    handle.disable()
    assert {
        torch.ops.flux2_fused.qk_norm_rope.default,
        torch.ops.flux2_fused.gated_resnorm.default,
        torch.ops.flux2_fused.modnorm.default,
    } <= targets
    assert torch.equal(compiled, expected)


@pytest.mark.parametrize("references", [0, 1], ids=["t2i", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_fused_branches_are_diffusers_bit_for_bit(
    references: int, dtype: torch.dtype, gated_resnorm_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every norm site one launch: a mode block's norm a block, a joint block's twin norms one launch
    of two segments, the output norm one."""
    _compare(
        support.transformer(dtype=dtype),
        monkeypatch,
        **support.step_inputs(references=references, dtype=dtype),
    )
    modes = 2 + references
    singles = support.TINY["num_single_layers"]
    assert len(gated_resnorm_on_cpu) == modes * support.TINY["num_layers"] + singles + 1
    assert gated_resnorm_on_cpu.count(2) == singles


@pytest.mark.parametrize("references", [0, 1], ids=["t2i", "reference"])
def test_proven_modulation_rows_are_read_once_a_batch(
    references: int, uniform_rows_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With uniform_rows' proofs (made on the CPU by its predicate) the norms read each batch's first
    modulation row for every token (the stand-in kernel reads them so): diffusers' bits, and every
    site that reads a proven modulation gets its word."""
    dtype = torch.bfloat16
    _compare(
        support.transformer(dtype=dtype),
        monkeypatch,
        **support.step_inputs(references=references, dtype=dtype),
    )
    layers, singles = support.TINY["num_layers"], support.TINY["num_single_layers"]
    # A mode stack: its first norm the modulation's word, each later one its pending gate's too.
    stacks = (2 + references) * (2 * layers - 1)
    if references:
        # The content rows (image, then reference) have no proof, and enter the joint blocks
        # concatenated: the text rows' words, both the first joint block's, one a block after it.
        assert sum(uniform_rows_on_cpu) == stacks + 1 + 2 * (singles - 1)
    else:
        # Twin norms: both gates and both modulations; the output norm: the pending content gate.
        assert sum(uniform_rows_on_cpu) == stacks + 4 * singles + 1


def test_a_hook_that_changes_the_modulation_revokes_its_proof(
    uniform_rows_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pre-hook on the first image mode block changes one token's modulation row in place, as
    eager's later blocks then read it too. Under inference mode torch keeps no version counter, so
    only the revocation (the block went to the host's call) stops the stack's proof: the next block
    reads every token's own row, and the output stays diffusers'."""
    dtype = torch.bfloat16
    model = support.transformer(dtype=dtype)

    def change(module: torch.nn.Module, args: tuple) -> None:
        args[1][:, -1] += 1  # temb_mod: positional in diffusers' loop and in the block code's call

    model.mode_blocks["image"][0].register_forward_pre_hook(change)
    _compare(model, monkeypatch, **support.step_inputs(dtype=dtype))
    layers = support.TINY["num_layers"]
    # The text stack proven throughout (its first norm one word, later ones two); the image stack's
    # proof revoked at its first block, which runs the block code under the hook without it.
    assert uniform_rows_on_cpu[: 2 * layers] == [1] + [2] * (layers - 1) + [0] * layers


def test_outside_inference_mode_an_in_place_change_ends_the_proof_by_itself(
    uniform_rows_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under no_grad torch counts versions: the same in-place change from a hook ends the stack's
    proof with the revocation switched off, and the output stays diffusers'."""
    dtype = torch.bfloat16
    model = support.transformer(dtype=dtype)

    def change(module: torch.nn.Module, args: tuple) -> None:
        args[1][:, -1] += 1

    model.mode_blocks["image"][0].register_forward_pre_hook(change)
    monkeypatch.setattr(support.FAMILY, "_revoke", lambda *proofs: None)
    inputs = support.step_inputs(dtype=dtype)
    with torch.no_grad(), attention_backend("native"):
        expected = model(**inputs).sample
        handle = enable(model)
        patched = model(**inputs).sample
        handle.disable()
    assert torch.equal(patched, expected)
    layers = support.TINY["num_layers"]
    assert uniform_rows_on_cpu[: 2 * layers] == [1] + [2] * (layers - 1) + [0] * layers
