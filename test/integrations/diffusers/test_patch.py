"""The diffusers patch on diffusers' own modules: enable, outputs equal diffusers', disable, restored;
adapters (peft), weight changes, moves, processors, hooks and KV modes each equal diffusers' output,
with the blocks the patch can vouch for still computed by the package's block code."""

from __future__ import annotations

import copy
import inspect
import types

import pytest
import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from flux2_fused.integrations.diffusers import DiffusersHost, enable, patch
from flux2_fused.integrations.diffusers.slots import forward_slots
from flux2_fused.models.flux2 import Flux2Config, Flux2Transformer

from ...conftest import count_block_code, fused_launches, fused_sites
from ...models.flux2.test_model import TINY, diffusers_model, image_ids, text_ids

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


@pytest.mark.gpu
@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_klein_4b_fuses_on_diffusers_modules(lora: bool):
    """diffusers' own klein-4B modules, with and without a peft LoRA: every site fused (the same
    launch count as the package's model: 41 residual/norm, 25 q/k/v prologues, 30 SwiGLUs; 96 in
    all), output equal to diffusers alone."""
    peft = pytest.importorskip("peft")
    config = Flux2Config.preset("klein-4b")
    reference = diffusers_model(Flux2Transformer.random(config, seed=5, device="cuda", dtype=torch.bfloat16))
    if lora:
        torch.manual_seed(0)
        targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_qkv_mlp_proj", "linear_in"]
        reference.add_adapter(
            peft.LoraConfig(r=8, lora_alpha=8, init_lora_weights=False, target_modules=targets)
        )
    inputs = _inputs(config, "cuda", torch.bfloat16, img=1024, txt=128)
    with torch.inference_mode(), attention_backend("native"):
        handle = enable(reference)
        patched = reference(**inputs).sample
        launches = fused_launches(lambda: reference(**inputs))
        handle.disable()
        expected = reference(**inputs).sample
    assert torch.equal(patched, expected)
    assert launches == fused_sites(config.num_layers, config.num_single_layers)


class _Wrapped(torch.nn.Module):
    """What an adapter does to a Linear: the original inside, one more term beside it."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base_layer = base
        self.extra = torch.nn.Linear(base.in_features, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.extra(x)


class Routes(dict):
    """How often each route ran; a block body's count is the length of its list of calls."""

    def __getitem__(self, key: str) -> int:
        value = super().__getitem__(key)
        return len(value) if isinstance(value, list) else value


@pytest.fixture
def routes(monkeypatch: pytest.MonkeyPatch) -> Routes:
    """Counts how each block and attention ran: the family's block code (from the loop or from a
    block's fused forward) or diffusers' own module calls."""
    counts = Routes(
        {
            "double": count_block_code(monkeypatch, "double_block_body"),
            "single": count_block_code(monkeypatch, "single_block_body"),
            "diffusers attention": 0,
            "diffusers single attention": 0,
            "diffusers ff": 0,
        }
    )
    module_calls = {
        "Flux2Attention": "diffusers attention",
        "Flux2ParallelSelfAttention": "diffusers single attention",
        "Flux2FeedForward": "diffusers ff",
    }
    real_call = DiffusersHost.call

    def call(host: DiffusersHost, module: torch.nn.Module, *args, **kwargs):
        name = module_calls.get(type(module).__name__)
        if name is not None:
            counts[name] += 1
        return real_call(host, module, *args, **kwargs)

    monkeypatch.setattr(DiffusersHost, "call", call)
    return counts


def _model() -> torch.nn.Module:
    return diffusers_model(Flux2Transformer.random(TINY, seed=5))


def _patched_and_diffusers(model: torch.nn.Module, change=None, dtype: torch.dtype = torch.float32):
    """(output with the patch, output of diffusers alone), after `change(model)` with the patch on."""
    handle = enable(model)
    if change is not None:
        change(model)
    inputs = _inputs(TINY, "cpu", dtype)
    with torch.inference_mode(), attention_backend("native"):
        patched = model(**inputs).sample
        handle.disable()
        expected = model(**inputs).sample
    return patched, expected


def _wrap_a_linear(model: torch.nn.Module) -> None:
    attn = model.transformer_blocks[0].attn
    attn.to_q = _Wrapped(attn.to_q)


def _scale_a_weight(model: torch.nn.Module) -> None:
    weight = model.single_transformer_blocks[0].attn.to_out.weight
    weight.data = weight.data * 2  # new storage, as fuse_lora and offload hooks do


def _scale_in_place(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model.transformer_blocks[0].ff.linear_in.weight.mul_(1.5)


def _assign_state_dict(model: torch.nn.Module) -> None:
    state = {k: v * 0.5 for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)


def _to_float64(model: torch.nn.Module) -> None:
    model.to(torch.float64)


def _row_wise_outputs_wait_later(model: torch.nn.Module) -> None:
    """Tensor parallelism's row-wise projections return their all-reduced output as an
    AsyncCollectiveTensor (waited on first use): the same here, on every such projection."""
    rows = [m.attn.to_out[0] for m in model.transformer_blocks] + [
        m.attn.to_add_out for m in model.transformer_blocks
    ]
    rows += [ff.linear_out for m in model.transformer_blocks for ff in (m.ff, m.ff_context)]
    rows += [m.attn.to_out for m in model.single_transformer_blocks]
    for linear in rows:
        linear.register_forward_hook(lambda module, args, out: AsyncCollectiveTensor(out))


CHANGES = {
    "adapter-like wrapper": _wrap_a_linear,
    "weight storage replaced": _scale_a_weight,
    "weight updated in place": _scale_in_place,
    "load_state_dict(assign=True)": _assign_state_dict,
    "dtype move": _to_float64,
    "row-wise outputs waited later": _row_wise_outputs_wait_later,
}


@pytest.mark.parametrize("change", CHANGES)
def test_changes_after_enable_stay_fused_and_equal_diffusers(change: str, routes: dict[str, int]) -> None:
    """Nothing is snapshotted: every block still runs the package's block code, on the modules and
    parameters as they are at call time, and the output is diffusers'."""
    dtype = torch.float64 if change == "dtype move" else torch.float32
    patched, expected = _patched_and_diffusers(_model(), CHANGES[change], dtype)
    assert torch.equal(patched, expected)
    assert routes["double"] == TINY.num_layers and routes["single"] == TINY.num_single_layers
    assert routes["diffusers attention"] == 0 and routes["diffusers ff"] == 0


def test_custom_processor_runs_diffusers_attention_in_that_block(routes: dict[str, int]) -> None:
    from diffusers.models.transformers.transformer_flux2 import Flux2AttnProcessor

    class Custom(Flux2AttnProcessor):
        pass

    def change(model: torch.nn.Module) -> None:
        model.transformer_blocks[1].attn.set_processor(Custom())

    patched, expected = _patched_and_diffusers(_model(), change)
    assert torch.equal(patched, expected)
    assert routes["diffusers attention"] == 1 and routes["double"] == TINY.num_layers


@pytest.mark.parametrize("how", ["context manager", "set_attention_backend"])
@pytest.mark.parametrize("backend", ["native", "_native_math"])
def test_every_attention_backend_stays_fused(backend: str, how: str, routes: dict[str, int]) -> None:
    """Default processors on any backend run the block code, which hands its q, k, v to diffusers'
    own attention dispatch with the processor's backend: the output is that backend's."""
    model = _model()
    handle = enable(model)
    inputs = _inputs(TINY, "cpu", torch.float32)
    with torch.inference_mode(), attention_backend(backend):  # also restores the global backend
        if how == "set_attention_backend":
            model.set_attention_backend(backend)
        patched = model(**inputs).sample
        handle.disable()
        expected = model(**inputs).sample
    assert torch.equal(patched, expected)
    assert routes["double"] == TINY.num_layers and routes["single"] == TINY.num_single_layers
    assert routes["diffusers attention"] == 0


def test_attention_gets_the_processors_backend_and_parallel_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a context-parallel config needs from the block code: each attention call carries its
    processor's backend and parallel config into diffusers' dispatch (which exchanges the rows)."""
    from diffusers.models.transformers import transformer_flux2

    seen = []
    dispatch = transformer_flux2.dispatch_attention_fn  # what the processors' module calls

    def recording(*args, **kwargs):
        seen.append((kwargs["backend"], kwargs["parallel_config"]))
        return dispatch(*args, **{**kwargs, "parallel_config": None})

    monkeypatch.setattr(transformer_flux2, "dispatch_attention_fn", recording)
    model = _model()
    model.set_attention_backend("_native_math")
    config = object()
    for block in (*model.transformer_blocks, *model.single_transformer_blocks):
        block.attn.processor._parallel_config = config
    patched, expected = _patched_and_diffusers(model)
    assert torch.equal(patched, expected)
    blocks = TINY.num_layers + TINY.num_single_layers
    assert seen[:blocks] == [("_native_math", config)] * blocks  # the patched call, then diffusers'


def test_hooked_block_runs_its_fused_forward_under_the_hook(routes: dict[str, int]) -> None:
    """A block with hooks is called as a module, so its hooks run, and the module's forward is the
    fused block forward (the streams materialized at its edges); a hooked feed-forward inside a plain
    block runs as diffusers' module call."""
    seen = []

    def change(model: torch.nn.Module) -> None:
        model.single_transformer_blocks[0].register_forward_hook(
            lambda m, a, o: seen.append(type(m).__name__)
        )
        model.transformer_blocks[0].ff.register_forward_pre_hook(lambda m, a: seen.append("ff"))

    patched, expected = _patched_and_diffusers(_model(), change)
    assert torch.equal(patched, expected)
    assert "Flux2SingleTransformerBlock" in seen and "ff" in seen
    assert routes["single"] == TINY.num_single_layers and routes["diffusers ff"] == 1


@pytest.mark.parametrize("kwargs", [{"scale": 1.0}, {"scale": 0.5, "unknown": 1}], ids=["scale", "extra"])
def test_joint_attention_kwargs_go_where_diffusers_sends_them(kwargs: dict, routes: dict[str, int]) -> None:
    """The LoRA scale scales the adapters for the call (here none: a no-op) and the blocks stay fused;
    other keys go to every attention call, which then runs as diffusers' (it warns and drops them)."""
    model = _model()
    handle = enable(model)
    inputs = _inputs(TINY, "cpu", torch.float32)
    with torch.inference_mode(), attention_backend("native"):
        patched = model(**inputs, joint_attention_kwargs=dict(kwargs)).sample
        handle.disable()
        expected = model(**inputs, joint_attention_kwargs=dict(kwargs)).sample
    assert torch.equal(patched, expected) and routes["double"] == TINY.num_layers
    assert routes["diffusers attention"] == (0 if kwargs == {"scale": 1.0} else TINY.num_layers)


def test_gradient_checkpointing_with_gradients_takes_diffusers_forward(routes: dict[str, int]) -> None:
    """diffusers' forward runs the call (it checkpoints each block); each block it calls runs its
    fused forward, whose sites decline to the eager chain where a gradient is needed."""
    model = _model()
    model.enable_gradient_checkpointing()
    handle = enable(model)
    inputs = _inputs(TINY, "cpu", torch.float32)
    with attention_backend("native"):
        patched = model(**inputs).sample
        handle.disable()
        expected = model(**inputs).sample
    assert torch.equal(patched, expected)
    assert routes["double"] == TINY.num_layers and routes["single"] == TINY.num_single_layers


def test_deepcopy_of_a_patched_model_computes_its_own_weights() -> None:
    model = _model()
    enable(model)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(0.5)
    inputs = _inputs(TINY, "cpu", torch.float32)
    with torch.inference_mode(), attention_backend("native"):
        patched = clone(**inputs).sample
        clone._flux2_fused_handle.disable()
        expected = clone(**inputs).sample
    assert torch.equal(patched, expected)


def test_deepcopy_of_a_patched_model_has_its_own_handle_everywhere() -> None:
    """The copy's blocks run their fused forward with the copy's handle (its switch), not the
    original's, and the copy's disable() leaves the original patched."""
    model = _model()
    handle = enable(model)
    clone = copy.deepcopy(model)
    copied = clone._flux2_fused_handle
    blocks = (*clone.transformer_blocks, *clone.single_transformer_blocks)
    assert copied is not handle and copied.transformer is clone and len(copied.blocks) == len(blocks)
    assert all(block._flux2_fused_handle() is copied for block in blocks)
    assert all(block.__dict__["forward"].block is block for block in blocks)
    copied.disable()
    assert all("forward" not in block.__dict__ for block in blocks)
    assert all("forward" in block.__dict__ for block in model.transformer_blocks)
    handle.disable()


def test_a_forward_wrapped_before_enable_is_kept_and_restored() -> None:
    """Another library's wrapper on the instance (accelerate's offload hooks set one): every call goes
    through it, and disable() puts it back."""
    model = _model()
    calls = []
    original = model.forward

    def wrapper(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    model.forward = wrapper
    handle = enable(model)
    with torch.inference_mode(), attention_backend("native"):
        model(**_inputs(TINY, "cpu", torch.float32))
    handle.disable()
    assert calls == [1] and model.forward is wrapper


def _accelerate_hook(model: torch.nn.Module, calls: list) -> None:
    """An accelerate hook on the transformer, as `enable_model_cpu_offload` and device maps add one."""
    hooks = pytest.importorskip("accelerate.hooks")

    class Counting(hooks.ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append("accelerate")
            return args, kwargs

    hooks.add_hook_to_module(model, Counting())


def _diffusers_hook(model: torch.nn.Module, calls: list) -> None:
    """A hook in diffusers' registry on the transformer, as context parallelism adds one (it splits the
    inputs before the forward) and caches do."""
    from diffusers.hooks import HookRegistry, ModelHook

    class Counting(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append("diffusers")
            return args, kwargs

    HookRegistry.check_if_exists_or_initialize(model).register_hook(Counting(), "counting")


def _replacing_hook(model: torch.nn.Module, calls: list) -> None:
    """A hook in diffusers' registry with its own `new_forward` (as FasterCache's and SeaCache's on the
    transformer): it decides whether to call the forward below, kept in `original_forward`."""
    from diffusers.hooks import HookRegistry, ModelHook

    class Replacing(ModelHook):
        def new_forward(self, module, *args, **kwargs):
            calls.append("replacing")
            return self.fn_ref.original_forward(*args, **kwargs)

    HookRegistry.check_if_exists_or_initialize(model).register_hook(Replacing(), "replacing")


HOOKS = {
    "accelerate and registry": ((_accelerate_hook, _diffusers_hook), ["accelerate", "diffusers"]),
    "own new_forward": ((_replacing_hook,), ["replacing"]),
}


@pytest.mark.parametrize("hooks", HOOKS)
@pytest.mark.parametrize("order", ["enable first", "hooks first"])
def test_hooks_on_the_transformer_run_around_the_fused_forward(
    order: str, hooks: str, routes: dict[str, int]
) -> None:
    """accelerate's and diffusers' hooks wrap the transformer's forward and end in the class's forward
    (or keep it in `original_forward`, for a hook with its own `new_forward`): `enable` puts the fused
    forward there, in either order, so the hooks run and every block fuses; `disable` puts the class's
    forward back and leaves the hooks."""
    add_hooks, names = HOOKS[hooks]
    model = _model()
    calls: list[str] = []
    if order == "enable first":
        handle = enable(model)
    for add in add_hooks:
        add(model, calls)
    if order == "hooks first":
        handle = enable(model)
    inputs = _inputs(TINY, "cpu", torch.float32)
    with torch.inference_mode(), attention_backend("native"):
        patched = model(**inputs).sample
        assert sorted(calls) == names
        assert routes["double"] == TINY.num_layers and routes["single"] == TINY.num_single_layers
        handle.disable()
        expected = model(**inputs).sample
    assert torch.equal(patched, expected)
    # hooks kept, blocks not fused, no fused forward left under the hooks
    assert sorted(calls) == sorted(names * 2) and routes["double"] == TINY.num_layers
    assert not any(
        getattr(getattr(holder, name), "__func__", None) is patch._fused_forward
        for holder, name in forward_slots(model)
    )


def test_enable_takes_a_pipeline() -> None:
    class Pipeline:
        def __init__(self, transformer: torch.nn.Module) -> None:
            self.transformer = transformer

    model = _model()
    handle = enable(Pipeline(model))
    assert handle.transformer is model and model._flux2_fused_handle is handle
    handle.disable()
    assert "forward" not in model.__dict__


def test_compile_repeated_blocks_runs_the_compiled_blocks(routes: dict[str, int]) -> None:
    """diffusers' `compile_repeated_blocks(fullgraph=True)` compiles each block module: the patch then
    calls the blocks (the user's compiled code), and the output is diffusers'."""

    def change(model: torch.nn.Module) -> None:
        model.compile_repeated_blocks(fullgraph=True, backend="eager")

    torch.compiler.reset()
    patched, expected = _patched_and_diffusers(_model(), change)
    assert torch.equal(patched, expected) and routes["double"] == 0 and routes["single"] == 0


def test_diffusers_cache_hooks_give_diffusers_outputs(routes: dict[str, int]) -> None:
    """diffusers' own caches on FLUX.2 (pyramid attention broadcast: attention outputs reused across
    calls by hooks on the attention modules) run as in diffusers over a run of calls: the hooked
    attention is diffusers' call, the rest of each block fused. (First-block cache fails on FLUX.2 in
    diffusers 0.42.1 itself: its tail hook subtracts the double block's output tuple.)"""
    from diffusers.hooks import PyramidAttentionBroadcastConfig

    calls = [_inputs(TINY, "cpu", torch.float32) for _ in range(3)]
    outputs = {}
    for patched, cached in ((True, True), (False, True), (False, False)):
        model = _model()
        if cached:
            model.enable_cache(
                PyramidAttentionBroadcastConfig(
                    spatial_attention_block_skip_range=2, current_timestep_callback=lambda: 500
                )
            )
        if patched:
            enable(model)
        with torch.inference_mode(), attention_backend("native"):
            outputs[patched, cached] = []
            for inputs in calls:
                with model.cache_context("cond"):
                    outputs[patched, cached].append(model(**inputs).sample)
    for ours, theirs in zip(outputs[True, True], outputs[False, True], strict=True):
        assert torch.equal(ours, theirs)
    assert not torch.equal(
        outputs[False, True][1], outputs[False, False][1]
    )  # call 2 reused call 1's attention
    assert routes["double"] == 3 * TINY.num_layers and routes["diffusers attention"] == 3 * TINY.num_layers


def test_torch_compile_of_the_patched_transformer_equals_diffusers() -> None:
    """torch.compile traces the patched forward: the fused sites become flux2_fused operators."""
    model = _model()
    graphs = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    handle = enable(model)
    inputs = _inputs(TINY, "cpu", torch.float32)
    torch.compiler.reset()
    with torch.inference_mode(), attention_backend("native"):
        compiled = torch.compile(model, fullgraph=True, backend=recording_backend)(**inputs).sample
        handle.disable()
        expected = model(**inputs).sample
    targets = [node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert torch.ops.flux2_fused.qk_norm_rope.default in targets
    assert torch.ops.flux2_fused.gated_resnorm.default in targets
    assert torch.equal(compiled, expected)


def test_gradients_equal_diffusers() -> None:
    """LoRA fine-tuning through the patch: where a gradient is needed every site is the eager chain,
    so the loss equals diffusers' and the adapter gradients match (summation order aside)."""
    peft_ = pytest.importorskip("peft")
    model = _model()
    torch.manual_seed(0)
    model.add_adapter(peft_.LoraConfig(r=4, init_lora_weights=False, target_modules=["to_q", "linear_in"]))
    inputs = _inputs(TINY, "cpu", torch.float32)
    results = {}
    for patched in (True, False):
        handle = enable(model) if patched else None
        model.zero_grad(set_to_none=True)
        with attention_backend("native"):
            loss = model(**inputs).sample.square().mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results[patched] = (loss.detach(), grads)
        if handle is not None:
            handle.disable()
    assert torch.equal(results[True][0], results[False][0])
    assert results[True][1].keys() == results[False][1].keys() and results[True][1]
    for name, grad in results[True][1].items():
        torch.testing.assert_close(grad, results[False][1][name])


def test_torchao_int8_weight_only_linears_equal_diffusers(routes: dict[str, int]) -> None:
    """Quantized linears (torchao int8 weight-only, bf16) are called as modules by the block code."""
    torchao = pytest.importorskip("torchao.quantization")
    model = _model().to(torch.bfloat16)
    torchao.quantize_(model, torchao.Int8WeightOnlyConfig())
    patched, expected = _patched_and_diffusers(model, dtype=torch.bfloat16)
    assert torch.equal(patched, expected)
    assert routes["double"] == TINY.num_layers and routes["single"] == TINY.num_single_layers


@pytest.mark.parametrize("offload_type", ["leaf_level", "block_level"])
def test_group_offload_equals_diffusers(offload_type: str, routes: dict[str, int]) -> None:
    """diffusers' group offloading wraps the modules it moves (CPU to CPU here): the block code calls
    the wrapped Linears and norms as modules, and blocks it wraps whole run as module calls."""

    def change(model: torch.nn.Module) -> None:
        cpu = torch.device("cpu")
        kwargs = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
        model.enable_group_offload(onload_device=cpu, offload_device=cpu, offload_type=offload_type, **kwargs)

    patched, expected = _patched_and_diffusers(_model(), change)
    assert torch.equal(patched, expected)
    if offload_type == "leaf_level":
        assert routes["double"] == TINY.num_layers  # blocks stay fused around the wrapped leaves


def use_kv_processors(model: torch.nn.Module) -> None:
    """diffusers' KV-cache processors on every block, as Flux2KleinKVPipeline sets them."""
    from diffusers.models.transformers.transformer_flux2 import (
        Flux2KVAttnProcessor,
        Flux2KVParallelSelfAttnProcessor,
    )

    for block in model.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in model.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())


def assert_same_kv_caches(ours: object, theirs: object) -> None:
    """Every layer's stored reference K and V equal, bit for bit."""
    pairs = zip(
        ours.double_block_caches + ours.single_block_caches,
        theirs.double_block_caches + theirs.single_block_caches,
        strict=True,
    )
    for mine, expected in pairs:
        assert torch.equal(mine.k_ref, expected.k_ref) and torch.equal(mine.v_ref, expected.v_ref)


def test_kv_cache_extract_then_cached_equals_diffusers(routes: dict[str, int]) -> None:
    """KV editing at the transformer: "extract" (reference rows first among the image rows, their own
    modulation at a fixed timestep, their K/V stored) then "cached" (the stored K/V injected): outputs
    and every stored K/V equal diffusers', with every block's attention in the block code (the fused
    q/k/v prologue handing diffusers' KV attention its q, k, v)."""

    model = _model()
    use_kv_processors(model)
    ref, img, txt = 9, 28, 11
    extract = _inputs(TINY, "cpu", torch.float32, img=ref + img, txt=txt)
    cached = {**_inputs(TINY, "cpu", torch.float32, img=img, txt=txt), "timestep": extract["timestep"]}
    results = {}
    for patched in (True, False):
        handle = enable(model) if patched else None
        with torch.inference_mode(), attention_backend("native"):
            first = model(**extract, kv_cache_mode="extract", num_ref_tokens=ref, ref_fixed_timestep=0.0)
            second = model(**cached, kv_cache=first.kv_cache, kv_cache_mode="cached").sample
        results[patched] = (first, second)
        if handle is not None:
            handle.disable()
    (f_first, f_second), (e_first, e_second) = results[True], results[False]
    assert torch.equal(f_first.sample, e_first.sample) and torch.equal(f_second, e_second)
    assert_same_kv_caches(f_first.kv_cache, e_first.kv_cache)
    # Both calls fully in the block code: the fused prologue, then diffusers' KV attention on its q, k, v.
    assert routes["double"] == 2 * TINY.num_layers and routes["diffusers attention"] == 0
    assert routes["single"] == 2 * TINY.num_single_layers and routes["diffusers single attention"] == 0


def _lora(model: torch.nn.Module, name: str = "default", seed: int = 0) -> None:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        init_lora_weights=False,  # random B, so the adapter changes the output
        target_modules=["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_qkv_mlp_proj", "linear_in"],
    )
    torch.manual_seed(seed)
    model.add_adapter(config, adapter_name=name)


LORA_WORKFLOWS = {
    "add_adapter": lambda m: _lora(m),
    "two adapters, set_adapters": lambda m: (
        _lora(m, "a", 1),
        _lora(m, "b", 2),
        m.set_adapters(["a", "b"], [0.7, 0.4]),
    ),
    "fuse_lora": lambda m: (_lora(m), m.fuse_lora()),
    "fuse then unfuse": lambda m: (_lora(m), m.fuse_lora(), m.unfuse_lora()),
    "disable_adapters": lambda m: (_lora(m), m.disable_adapters()),
}


@pytest.mark.parametrize("workflow", LORA_WORKFLOWS)
@pytest.mark.parametrize("before", [True, False], ids=["lora-then-enable", "enable-then-lora"])
def test_lora_workflows_equal_diffusers(workflow: str, before: bool, routes: dict[str, int]) -> None:
    model = _model()
    if before:
        LORA_WORKFLOWS[workflow](model)
        patched, expected = _patched_and_diffusers(model)
    else:
        patched, expected = _patched_and_diffusers(model, LORA_WORKFLOWS[workflow])
    assert torch.equal(patched, expected)
    assert routes["double"] == TINY.num_layers and routes["single"] == TINY.num_single_layers


def test_lora_changes_the_output() -> None:
    """The adapters above act (so the equalities compare outputs that LoRA changed)."""
    model = _model()
    before, _ = _patched_and_diffusers(model)
    _lora(model)
    after, _ = _patched_and_diffusers(model)
    assert not torch.equal(before, after)


def test_saved_lora_loads_and_equals_diffusers(tmp_path) -> None:
    source = _model()
    _lora(source)
    source.save_lora_adapter(str(tmp_path), adapter_name="default")
    model = _model()
    base, _ = _patched_and_diffusers(model)
    files = sorted(p.name for p in tmp_path.iterdir())
    model.load_lora_adapter(str(tmp_path), weight_name=files[0], adapter_name="saved", prefix=None)
    patched, expected = _patched_and_diffusers(model)
    assert torch.equal(patched, expected) and not torch.equal(patched, base)


def test_lora_scale_in_joint_attention_kwargs_equals_diffusers(routes: dict[str, int]) -> None:
    """`joint_attention_kwargs={"scale": s}` (what pipelines pass for `lora_scale`) scales the adapters
    for that call only, as diffusers' forward does, and every block stays fused."""
    model = _model()
    _lora(model)
    handle = enable(model)
    inputs = _inputs(TINY, "cpu", torch.float32)
    with torch.inference_mode(), attention_backend("native"):
        scaled = model(**inputs, joint_attention_kwargs={"scale": 0.3}).sample
        unscaled = model(**inputs).sample
        handle.disable()
        expected_scaled = model(**inputs, joint_attention_kwargs={"scale": 0.3}).sample
        expected = model(**inputs).sample
    assert torch.equal(scaled, expected_scaled) and torch.equal(unscaled, expected)
    assert not torch.equal(scaled, unscaled)
    assert routes["double"] == 2 * TINY.num_layers and routes["diffusers attention"] == 0
    assert routes["single"] == 2 * TINY.num_single_layers and routes["diffusers single attention"] == 0


def test_enable_installs_again_after_the_fused_forward_was_replaced() -> None:
    model = _model()
    first = enable(model)
    model.forward = types.MethodType(type(model).forward, model)  # someone put diffusers' forward back
    second = enable(model)
    assert second is not first and model.forward == second.method


def test_positional_joint_attention_kwargs_are_not_a_lora_scale(routes: dict[str, int]) -> None:
    """diffusers scales LoRA layers only for `joint_attention_kwargs=` given by keyword; given
    positionally the dict goes to the attention calls whole (which drop "scale")."""
    model = _model()
    _lora(model)
    handle = enable(model)
    x = _inputs(TINY, "cpu", torch.float32)
    args = (
        x["hidden_states"],
        x["encoder_hidden_states"],
        x["timestep"],
        x["img_ids"],
        x["txt_ids"],
        x["guidance"],
    )
    with torch.inference_mode(), attention_backend("native"):
        patched = model(*args, {"scale": 0.3}).sample
        handle.disable()
        expected = model(*args, {"scale": 0.3}).sample
        unscaled = model(*args).sample
    assert torch.equal(patched, expected) and torch.equal(expected, unscaled)


def test_kv_arguments_diffusers_drops_are_dropped() -> None:
    """A `num_txt_tokens` in `joint_attention_kwargs` reaches only the single blocks' KV processor
    (the double blocks' takes the text rows from its input), and a "cached" call without a cache
    raises as diffusers' does."""

    model = _model()
    use_kv_processors(model)
    inputs = _inputs(TINY, "cpu", torch.float32, img=37, txt=11)
    extract = {
        "kv_cache_mode": "extract",
        "num_ref_tokens": 9,
        "joint_attention_kwargs": {"num_txt_tokens": 11},
    }
    outputs, errors = [], []
    for patched in (True, False):
        handle = enable(model) if patched else None
        with torch.inference_mode(), attention_backend("native"):
            outputs.append(model(**inputs, **extract).sample)
            with pytest.raises(TypeError) as raised:
                model(**inputs, kv_cache_mode="cached")
            errors.append(str(raised.value))
        if handle is not None:
            handle.disable()
    assert torch.equal(outputs[0], outputs[1]) and errors[0] == errors[1]


@pytest.mark.parametrize("kv", [False, True], ids=["plain", "kv-extract"])
def test_modules_are_called_in_diffusers_order(kv: bool) -> None:
    """Stateful wrappers (adapter dropout drawing random numbers, offload prefetch order) see the
    modules they wrap called in diffusers' order, KV extraction's reference modulation included."""

    model = _model()
    if kv:
        use_kv_processors(model)
    order: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or name in ("pos_embed", "time_guidance_embed"):
            module.register_forward_pre_hook(lambda m, a, name=name: order.append(name))
    inputs = _inputs(TINY, "cpu", torch.float32, img=37, txt=11)
    extra = {"kv_cache_mode": "extract", "num_ref_tokens": 9} if kv else {}
    orders = []
    for patched in (True, False):
        handle = enable(model) if patched else None
        order.clear()
        with torch.inference_mode(), attention_backend("native"):
            model(**inputs, **extra)
        orders.append(list(order))
        if handle is not None:
            handle.disable()
    assert orders[0] == orders[1] and len(orders[0]) > 20


# --------------------------------------------------------------------------- what a module call may hide


@pytest.mark.parametrize("how", ["replaced", "hooked"])
def test_a_changed_swiglu_gate_runs_as_diffusers_module(how: str, routes: dict[str, int]) -> None:
    """The SwiGLU's SiLU (`gate_fn`) replaced or hooked: the op would compute silu itself, so the
    feed-forward (and the single block's attention + MLP) run as diffusers' module calls."""

    def change(model: torch.nn.Module) -> None:
        for act in (
            model.transformer_blocks[0].ff.act_fn,
            model.single_transformer_blocks[0].attn.mlp_act_fn,
        ):
            if how == "replaced":
                act.gate_fn = torch.nn.GELU()
            else:
                act.gate_fn.register_forward_hook(lambda m, a, o: o * 2)

    patched, expected = _patched_and_diffusers(_model(), change)
    assert torch.equal(patched, expected)
    assert routes["diffusers ff"] == 1 and routes["diffusers single attention"] == 1


def test_backward_hooks_keep_their_module_call() -> None:
    """A full backward hook on a block: the block runs as a module call (its fused forward), so the
    hook sees the block's gradients and every parameter gradient equals diffusers'."""
    model = _model()
    seen: list[str] = []
    model.transformer_blocks[1].register_full_backward_pre_hook(
        lambda m, grad_output: (
            seen.append("hook"),
            tuple(None if g is None else 0.5 * g for g in grad_output),
        )[1]
    )
    inputs = _inputs(TINY, "cpu", torch.float32)
    grads = {}
    for patched in (True, False):
        handle = enable(model) if patched else None
        model.zero_grad()
        with attention_backend("native"):
            model(**inputs).sample.sum().backward()
        if handle is not None:
            handle.disable()
        grads[patched] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert seen == ["hook", "hook"]
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False], strict=True))


def test_hooked_qk_norms_run_in_diffusers_order() -> None:
    order: list[str] = []
    model = _model()
    attn = model.transformer_blocks[0].attn
    for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        getattr(attn, name).register_forward_pre_hook(lambda m, a, name=name: order.append(name))
    patched, expected = _patched_and_diffusers(model)
    assert torch.equal(patched, expected)
    assert order == ["norm_q", "norm_k", "norm_added_q", "norm_added_k"] * 2  # patched, then diffusers


# --------------------------------------------------------------------------- enabling again, copies


def test_enable_again_under_a_wrapper_of_the_old_forward_does_not_loop() -> None:
    """A wrapper set on the instance around the fused forward, then enable() again: the new fused
    forward stays outermost and calls the wrapper, which ends in the old fused forward; that inner
    call runs diffusers' own forward instead of coming back around."""
    model = _model()
    enable(model)
    inner = model.forward
    calls = []
    model.forward = lambda *a, **k: calls.append(1) or inner(*a, **k)
    handle = enable(model)
    inputs = _inputs(TINY, "cpu", torch.float32)
    with torch.inference_mode(), attention_backend("native"):
        patched = model(**inputs).sample
        handle.disable()
        expected = type(model).forward(model, **inputs).sample
    assert torch.equal(patched, expected) and calls == [1]


def test_enable_afresh_takes_the_blocks_and_disable_restores_them(routes: dict[str, int]) -> None:
    """The fused forward replaced from outside, enable() again: the old handle is undone, the new one
    holds every block, and its disable() leaves diffusers' own forwards everywhere."""
    model = _model()
    first = enable(model)
    model.forward = types.MethodType(type(model).forward, model)
    second = enable(model)
    blocks = (*model.transformer_blocks, *model.single_transformer_blocks)
    assert second is not first and len(second.blocks) == len(blocks)
    second.disable()
    assert all("forward" not in block.__dict__ for block in blocks)
    with torch.inference_mode(), attention_backend("native"):
        model(**_inputs(TINY, "cpu", torch.float32))
    assert routes["double"] == 0 and routes["single"] == 0


def test_a_saved_patched_model_loads_patched(routes: Routes, tmp_path) -> None:
    """torch.save of the whole patched model and torch.load: the loaded model carries its own handle,
    its blocks point to it, it runs every block on the block code and computes diffusers' output; a
    block saved on its own carries no model, and runs diffusers' forward."""
    model = _model()
    handle = enable(model)
    torch.save(model, tmp_path / "model.pt")
    torch.save(model.transformer_blocks[0], tmp_path / "block.pt")
    handle.disable()
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    copied = loaded._flux2_fused_handle
    blocks = (*loaded.transformer_blocks, *loaded.single_transformer_blocks)
    assert copied is not handle and copied.transformer is loaded and copied.method.transformer is loaded
    assert all(block._flux2_fused_handle() is copied for block in blocks)
    inputs = _inputs(TINY, "cpu", torch.float32)
    with torch.inference_mode(), attention_backend("native"):
        patched = loaded(**inputs).sample
        counted = (routes["double"], routes["single"])
        expected = model(**inputs).sample
    assert counted == (TINY.num_layers, TINY.num_single_layers) and torch.equal(patched, expected)
    block = torch.load(tmp_path / "block.pt", weights_only=False)
    assert block._flux2_fused_handle() is None
    assert (tmp_path / "block.pt").stat().st_size < (tmp_path / "model.pt").stat().st_size / 2


def test_the_patched_forward_shows_diffusers_signature() -> None:
    """A pipeline that inspects `transformer.forward` sees the arguments diffusers' forward takes."""
    model = _model()
    before = inspect.signature(model.forward)
    handle = enable(model)
    assert inspect.signature(model.forward) == before
    handle.disable()


def test_a_copied_block_does_not_copy_the_model() -> None:
    model = _model()
    handle = enable(model)
    block = copy.deepcopy(model.transformer_blocks[0])
    params = sum(p.numel() for p in block.parameters())
    assert sum(p.numel() for p in model.transformer_blocks[0].parameters()) == params
    assert block._flux2_fused_handle() is handle  # a weak reference, shared, not a copied model
    handle.disable()


def test_compiled_kv_extraction_with_reference_rows_equals_diffusers() -> None:
    """KV extraction's per-token modulation under torch.compile: the pending single-block update's
    per-token gate is cut to the output rows with the stream."""
    model = _model()
    use_kv_processors(model)
    inputs = _inputs(TINY, "cpu", torch.float32, img=9 + 28)
    handle = enable(model)
    torch.compiler.reset()
    try:
        with torch.inference_mode(), attention_backend("native"):
            compiled = torch.compile(model, backend="eager")(
                **inputs, kv_cache_mode="extract", num_ref_tokens=9
            )
            handle.disable()
            expected = model(**inputs, kv_cache_mode="extract", num_ref_tokens=9)
    finally:
        torch.compiler.reset()
    assert torch.equal(compiled.sample, expected.sample)


def test_the_handle_says_whether_kernels_can_run_where_the_model_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """`print(handle)` of an active patch on a CPU model must not read as kernels running there; the
    answer is the ops' own (`fast_path_reason`) for the device and dtype of the model's parameters."""
    from flux2_fused import integrations

    model = _model()
    handle = enable(model)
    assert repr(handle) == (
        "FusedHandle(Flux2Transformer2DModel, fused=True, active, "
        "kernels off here: the fused ops run on CUDA GPUs, not on cpu)"
    )
    asked = []
    monkeypatch.setattr(integrations, "fast_path_reason", lambda *where: asked.append(where))
    assert repr(handle) == "FusedHandle(Flux2Transformer2DModel, fused=True, active, kernels can run on cpu)"
    assert asked == [(torch.device("cpu"), torch.float32)]
    handle.disable()
    assert repr(handle) == "FusedHandle(Flux2Transformer2DModel, fused=True, disabled)"
