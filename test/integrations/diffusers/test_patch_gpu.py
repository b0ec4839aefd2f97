"""GPU matrix of `enable()` on both families' diffusers transformers (random weights, bf16, 1024 image +
128 text tokens, batch 2): klein-4B for FLUX.2, and FLUX.1-dev's width (24 heads of 128) with 2 double
and 4 single blocks for FLUX.1. Moves, CPU offloading, quantized linears, every attention backend this
machine runs, LoRA adapters fused and unfused, a LoRA training step (with and without gradient
checkpointing), hooks, torch.compile of the patched model; for FLUX.2 also KV editing and the
inpainting and Flux2 (input image) pipelines. Each output equals diffusers' with the same setup and no
patch, and our kernel launches in a call are counted and must be exactly the README's: every site
(`conftest.fused_sites`: 96 at klein-4B, 27 for FLUX.1's 2 double and 4 single blocks) where the setup
leaves every site to the block code, fewer by exactly the sites that hooks make module calls."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from flux2_fused.bench import flux1, hosts
from flux2_fused.integrations.diffusers import enable
from flux2_fused.models.flux2 import Flux2Config
from flux2_fused.ops import float8_quant

from ...conftest import SITE_KERNELS, fused_launches, fused_sites
from .test_patch import _inputs, assert_same_kv_caches, use_kv_processors

pytestmark = pytest.mark.gpu
diffusers = pytest.importorskip("diffusers")
dispatch = pytest.importorskip("diffusers.models.attention_dispatch")

CONFIG = Flux2Config.preset("klein-4b")
CUDA = torch.device("cuda")
Setup = Callable[[nn.Module], object]
# FLUX.1-dev's blocks at full width, fewer of them: every kernel sees dev's shapes.
FLUX1_BLOCKS = {"num_layers": 2, "num_single_layers": 4}


@dataclasses.dataclass(frozen=True)
class Family:
    """How the matrix builds one family's model (the same random weights every time), its inputs, a
    pipeline holding it, the Linears a training LoRA adapts, and how many blocks of each kind the
    model has (which decides its launch counts)."""

    name: str
    model: Callable[[], nn.Module]
    inputs: Callable[[], dict]
    pipeline: Callable[[nn.Module], object]
    lora_targets: tuple[str, ...]
    training_targets: tuple[str, ...]
    double_blocks: int
    single_blocks: int

    @property
    def sites(self) -> int:
        """Our launches in one call with every site fused."""
        return fused_sites(self.double_blocks, self.single_blocks)

    @property
    def prologues(self) -> int:
        """The q/k/v prologue launches among them: one a block."""
        return self.double_blocks + self.single_blocks


def _flux1_inputs() -> dict:
    inputs = flux1.step_inputs("flux1-dev", 2, 1024, 128, torch.bfloat16, seed=11)
    return {
        **inputs,
        "timestep": torch.rand(2, device="cuda", generator=torch.Generator("cuda").manual_seed(2)),
    }


FAMILIES = {
    "flux2": Family(
        "flux2",
        lambda: hosts.diffusers_host(CONFIG, CUDA, torch.bfloat16, seed=5),
        lambda: _inputs(CONFIG, "cuda", torch.bfloat16, img=1024, txt=128),
        lambda model: hosts.klein_pipeline(diffusers.Flux2KleinPipeline, model),
        hosts.LORA_TARGETS,
        ("to_q", "linear_in"),
        CONFIG.num_layers,
        CONFIG.num_single_layers,
    ),
    "flux1": Family(
        "flux1",
        lambda: flux1.random_transformer("flux1-dev", CUDA, torch.bfloat16, seed=5, **FLUX1_BLOCKS),
        _flux1_inputs,
        flux1.pipeline,
        flux1.LORA_TARGETS,
        ("to_q", "proj_mlp"),
        FLUX1_BLOCKS["num_layers"],
        FLUX1_BLOCKS["num_single_layers"],
    ),
}
# Tests of FLUX.2-only features take the FLUX.2 family alone.
FLUX2_ONLY = pytest.mark.parametrize("family", ["flux2"], indirect=True)


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> Family:
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def inputs(family: Family) -> dict:
    return family.inputs()


@pytest.fixture(scope="module")
def plain(family: Family) -> Iterator[nn.Module]:
    """The plain model (no setup), shared by the tests that change only how it is called."""
    model = family.model()
    yield model
    del model
    _free()


@pytest.fixture(scope="module")
def fully_fused(family: Family, plain: nn.Module, inputs: dict) -> int:
    """Our launches in one call of the plain patched model, which fuses every site (96 at klein-4B):
    the count the other setups are held to."""
    handle = enable(plain)
    with torch.inference_mode():
        plain(**inputs)
        launches = fused_launches(lambda: plain(**inputs))
    handle.disable()
    assert launches == family.sites
    return launches


def _outcome(family: Family, setup: Setup, inputs: dict, enable_at: str | None) -> tuple[torch.Tensor, int]:
    """A fresh model's output after `setup`, with enable() "first", "last" or not at all (None), and
    the block sites' launches in one more call."""
    model = family.model()
    if enable_at == "first":
        enable(model)
    setup(model)
    if enable_at == "last":
        enable(model)
    with torch.inference_mode():
        out = model(**inputs).sample.cpu()
        return out, fused_launches(lambda: model(**inputs), SITE_KERNELS)


def _patched_vs_diffusers(
    family: Family,
    setup: Setup,
    inputs: dict,
    patch_first: bool = False,
    diffusers_fails: tuple[type[Exception], ...] = (),
) -> int:
    """`setup` and enable() (in either order) give the output of `setup` alone; returns our launches
    in one patched call. Skips where diffusers alone raises one of `diffusers_fails` (nothing to match)."""
    try:
        expected, unpatched = _outcome(family, setup, inputs, None)
    except diffusers_fails as exc:
        pytest.skip(f"diffusers alone fails with this setup here: {type(exc).__name__}: {exc}")
    _free()
    patched, launches = _outcome(family, setup, inputs, "first" if patch_first else "last")
    _free()
    assert unpatched == 0 and torch.equal(patched, expected)
    return launches


ORDERS = pytest.mark.parametrize("patch_first", [False, True], ids=["setup-then-enable", "enable-then-setup"])


def _image_512(seed: int = 5) -> object:
    """A random 512x512 RGB PIL image."""
    from PIL import Image

    pixels = torch.randint(
        0, 256, (512, 512, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8
    )
    return Image.fromarray(pixels.numpy())


def _call_512(pipe: object, **kwargs: object) -> Callable[[], torch.Tensor]:
    """A 512x512 two-step call of `pipe` with a fixed seed and its own arguments `kwargs`; the images."""

    def call() -> torch.Tensor:
        return pipe(
            **kwargs,
            height=512,
            width=512,
            num_inference_steps=2,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
        ).images

    return call


def _alone_then_enabled(
    pipe: object, call: Callable[[], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A pipeline call's images alone, then with `enable(pipe)`, and our launches in one more call."""
    with torch.inference_mode():
        expected = call()
        handle = enable(pipe)
        patched = call()
        launches = fused_launches(call)
        handle.disable()
    return expected, patched, launches


# --------------------------------------------------------------------------- moves


@ORDERS
def test_device_and_dtype_moves_stay_fully_fused(
    family: Family, patch_first: bool, inputs: dict, fully_fused: int
) -> None:
    """The transformer moved to the CPU in fp32, put in a pipeline there, the pipeline moved to the GPU
    (`pipe.to("cuda")`) and the transformer back to bf16 (`.to(dtype)`), enable() before or after the
    moves: every site fuses on the moved parameters."""

    def setup(model: nn.Module) -> object:
        model.to("cpu", torch.float32)
        pipe = family.pipeline(model)
        pipe.to("cuda")
        model.to(torch.bfloat16)
        return pipe

    assert _patched_vs_diffusers(family, setup, inputs, patch_first) == fully_fused


# --------------------------------------------------------------------------- offloading


@ORDERS
def test_model_cpu_offload_stays_fully_fused(
    family: Family, patch_first: bool, inputs: dict, fully_fused: int
) -> None:
    """enable_model_cpu_offload puts accelerate's hook on the transformer's forward; the fused forward
    runs inside it whichever comes first."""

    def setup(model: nn.Module) -> object:
        pipe = family.pipeline(model)
        pipe.enable_model_cpu_offload(device="cuda")
        return pipe

    assert _patched_vs_diffusers(family, setup, inputs, patch_first) == fully_fused


@ORDERS
def test_sequential_cpu_offload_equals_diffusers(
    family: Family, patch_first: bool, inputs: dict, fully_fused: int
) -> None:
    """Sequential offload hooks every module that holds parameters of its own: the Linears, whose
    calls the block code makes anyway, and the q/k RMSNorms, so each block's prologue runs as module
    calls and every other site fuses (71 of 96 launches at klein-4B). (Some accelerate and torch
    versions fail here without the patch, in set_module_tensor_to_device re-wrapping a parameter:
    TypeError from Tensor.new; then there is nothing to compare.)"""

    def setup(model: nn.Module) -> object:
        pipe = family.pipeline(model)
        pipe.enable_sequential_cpu_offload(device="cuda")
        return pipe

    launches = _patched_vs_diffusers(family, setup, inputs, patch_first, diffusers_fails=(TypeError,))
    assert launches == fully_fused - family.prologues


@ORDERS
@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_group_offload_equals_diffusers(
    family: Family, offload_type: str, patch_first: bool, inputs: dict, fully_fused: int
) -> None:
    def setup(model: nn.Module) -> None:
        model.to("cpu")
        group = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
        model.enable_group_offload(
            onload_device=CUDA,
            offload_device=torch.device("cpu"),
            offload_type=offload_type,
            use_stream=True,
            **group,
        )

    launches = _patched_vs_diffusers(family, setup, inputs, patch_first)
    # Block level hooks only the blocks, which run their fused forward under the hooks: every site
    # fuses (96 of 96 at klein-4B). Leaf level hooks the Linears and, as the parents of parameters no
    # Linear holds, the q/k norms: each block's prologue runs as module calls (71 of 96).
    expected = fully_fused if offload_type == "block_level" else fully_fused - family.prologues
    assert launches == expected


# --------------------------------------------------------------------------- quantized linears


@pytest.mark.parametrize("config_name", ["Int8WeightOnlyConfig", "Float8WeightOnlyConfig"])
def test_torchao_weight_only_stays_fully_fused(
    family: Family, config_name: str, inputs: dict, fully_fused: int
) -> None:
    quantization = pytest.importorskip("torchao.quantization")
    if config_name.startswith("Float8") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs sm_89 or newer")

    def setup(model: nn.Module) -> None:
        quantization.quantize_(model, getattr(quantization, config_name)())

    assert _patched_vs_diffusers(family, setup, inputs) == fully_fused


@pytest.mark.parametrize(
    "config_name, granularity",
    [
        ("Float8DynamicActivationFloat8WeightConfig", "PerRow"),
        ("Float8DynamicActivationFloat8WeightConfig", "PerTensor"),
        ("Int8DynamicActivationInt8WeightConfig", None),
    ],
)
def test_torchao_dynamic_quantization_stays_fully_fused(
    family: Family, config_name: str, granularity: str | None, inputs: dict, fully_fused: int
) -> None:
    """Dynamically quantized activations and weights (torchao): every elementwise site around the
    quantized linears fuses, the block code's float8 linears get their inputs from `float8_quant`
    or from the activation's own kernel (per row its quantizing epilogue, per tensor its joint form;
    int8 linears run as modules), and the output is the quantized model's alone."""
    quantization = pytest.importorskip("torchao.quantization")
    if config_name.startswith("Float8") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs sm_89 or newer")
    kwargs = {} if granularity is None else {"granularity": getattr(quantization, granularity)()}

    def setup(model: nn.Module) -> None:
        quantization.quantize_(model, getattr(quantization, config_name)(**kwargs))

    assert _patched_vs_diffusers(family, setup, inputs) == fully_fused
    model = family.model()
    setup(model)
    enable(model)
    with torch.inference_mode():
        model(**inputs)
        quantized = fused_launches(lambda: model(**inputs), (float8_quant.KERNEL,))
        epilogues = fused_launches(lambda: model(**inputs), ("_kernel_quantized",))
        joints = fused_launches(lambda: model(**inputs), ("_kernel_joint",))
        norms = fused_launches(lambda: model(**inputs), ("gated_resnorm_kernel_quantized",))
    assert (quantized > 0) == config_name.startswith("Float8")
    # per row, the norms hand their float8 Linears their quantization (the norm's own kernel)
    assert (norms > 0) == (granularity == "PerRow")
    # the activations before the output projections come quantized from their op's kernel per row,
    # and per tensor as joint rows with their amax words from it
    assert (epilogues > 0) == (granularity == "PerRow")
    assert (joints > 0) == (granularity == "PerTensor")


@pytest.mark.parametrize("granularity", ["PerRow", "PerTensor"])
def test_torchao_float8_under_torch_compile_traces_the_fused_sites(
    family: Family, granularity: str, inputs: dict
) -> None:
    """torch.compile(fullgraph=True) of a patched transformer with torchao float8 linears: the graph
    holds the quantized linears and the flux2_fused operators; run as traced (a backend that executes
    the graph as is), the output is the quantized model's own eager output."""
    quantization = pytest.importorskip("torchao.quantization")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs sm_89 or newer")
    model = family.model()
    config = quantization.Float8DynamicActivationFloat8WeightConfig(
        granularity=getattr(quantization, granularity)()
    )
    quantization.quantize_(model, config)
    graphs = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    with torch.inference_mode():
        expected = model(**inputs).sample
    handle = enable(model)
    torch.compiler.reset()
    try:
        with torch.inference_mode():
            compiled = torch.compile(model, fullgraph=True, backend=recording_backend)(**inputs).sample
    finally:
        handle.disable()
        torch.compiler.reset()
    targets = {node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert torch.ops.flux2_fused.gated_resnorm.default in targets
    assert torch.ops.flux2_fused.qk_norm_rope.default in targets
    assert torch.equal(compiled, expected)


def test_bitsandbytes_nf4_equals_diffusers(family: Family, tmp_path, inputs: dict, fully_fused: int) -> None:
    """NF4 linears loaded through diffusers' BitsAndBytesConfig (from a saved random model)."""
    pytest.importorskip("bitsandbytes")
    saved = family.model()
    saved.save_pretrained(tmp_path)
    cls = type(saved)
    del saved
    _free()
    quantization = diffusers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    )
    model = cls.from_pretrained(tmp_path, quantization_config=quantization, torch_dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = model(**inputs).sample
        handle = enable(model)
        patched = model(**inputs).sample
        launches = fused_launches(lambda: model(**inputs))
        handle.disable()
    assert torch.equal(patched, expected)
    assert launches == fully_fused  # the NF4 linears are host.linear calls; every other site fuses


# --------------------------------------------------------------------------- attention backends


@pytest.mark.parametrize("backend", [name.value for name in dispatch.AttentionBackendName])
def test_every_attention_backend_stays_fully_fused(
    backend: str, plain: nn.Module, inputs: dict, fully_fused: int
) -> None:
    """Default processors on any backend this machine runs (diffusers alone must run it; the others
    skip) are fused around that backend's attention: the output is diffusers' with that backend.
    The backend is set both ways, globally (`attention_backend`, restored on exit) and on the
    processors (`set_attention_backend`, reset after)."""
    with contextlib.ExitStack() as undo:
        try:
            undo.enter_context(dispatch.attention_backend(backend))  # raises where requirements are unmet
            undo.callback(plain.reset_attention_backend)
            plain.set_attention_backend(backend)
            with torch.inference_mode():
                expected = plain(**inputs).sample
        except Exception as exc:
            pytest.skip(f"diffusers alone cannot run {backend} here: {type(exc).__name__}: {exc}")
        handle = enable(plain)
        undo.callback(handle.disable)
        with torch.inference_mode():
            patched = plain(**inputs).sample
            launches = fused_launches(lambda: plain(**inputs))
    assert torch.equal(patched, expected)
    assert launches == fully_fused


# --------------------------------------------------------------------------- LoRA


@ORDERS
def test_two_adapters_fused_then_unfused_stay_fully_fused(
    family: Family, patch_first: bool, inputs: dict, fully_fused: int
) -> None:
    pytest.importorskip("peft")

    def setup(model: nn.Module) -> None:
        hosts.add_lora(model, 16, "a", seed=1, targets=family.lora_targets)
        hosts.add_lora(model, 16, "b", seed=2, targets=family.lora_targets)
        model.set_adapters(["a", "b"], [0.7, 0.4])
        model.fuse_lora()
        model.unfuse_lora()

    assert _patched_vs_diffusers(family, setup, inputs, patch_first) == fully_fused


# --------------------------------------------------------------------------- inpainting


@FLUX2_ONLY
def test_klein_inpaint_pipeline_equals_diffusers(family: Family, fully_fused: int) -> None:
    """Flux2KleinInpaintPipeline at 512x512 (1024 image tokens) with CFG: the same image with and
    without enable(), every transformer call fully fused."""
    from PIL import Image

    pipe = hosts.klein_pipeline(diffusers.Flux2KleinInpaintPipeline, family.model())
    gen = torch.Generator().manual_seed(7)
    pixels = torch.randint(0, 256, (512, 512, 3), generator=gen, dtype=torch.uint8)
    mask = (torch.rand(512, 512, generator=gen) > 0.5).to(torch.uint8) * 255
    embeds, negative = (
        torch.randn(1, 128, CONFIG.joint_attention_dim, generator=gen).to(CUDA, torch.bfloat16)
        for _ in range(2)
    )

    def call() -> torch.Tensor:
        return pipe(
            image=Image.fromarray(pixels.numpy()),
            mask_image=Image.fromarray(mask.numpy()),
            prompt_embeds=embeds,
            negative_prompt_embeds=negative,
            strength=0.75,
            num_inference_steps=4,
            guidance_scale=4.0,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
        ).images

    expected, patched, launches = _alone_then_enabled(pipe, call)
    assert torch.equal(patched, expected)
    assert launches == 3 * 2 * fully_fused  # strength 0.75 of 4 steps: 3 steps, two calls each (CFG)


# --------------------------------------------------------------------------- KV-cache editing


@FLUX2_ONLY
def test_kv_editing_equals_diffusers_and_the_cached_calls_fully_fuse(
    plain: nn.Module, fully_fused: int
) -> None:
    """Flux2KleinKVPipeline's transformer calls on klein-4B: "extract" (reference rows among the image
    rows, their K/V stored; its per-token modulation keeps those norm sites eager) then "cached" (the
    stored K/V injected): outputs and stored K/V equal diffusers', and a cached call fuses every site."""

    use_kv_processors(plain)
    ref, img, txt = 256, 1024, 128
    extract = _inputs(CONFIG, "cuda", torch.bfloat16, img=ref + img, txt=txt)
    cached = {**_inputs(CONFIG, "cuda", torch.bfloat16, img=img, txt=txt), "timestep": extract["timestep"]}
    results = {}
    try:
        for patched in (True, False):
            handle = enable(plain) if patched else None
            with torch.inference_mode():
                first = plain(**extract, kv_cache_mode="extract", num_ref_tokens=ref, ref_fixed_timestep=0.0)
                second = plain(**cached, kv_cache=first.kv_cache, kv_cache_mode="cached").sample
                again = functools.partial(plain, **cached, kv_cache=first.kv_cache, kv_cache_mode="cached")
                launches = fused_launches(again)
            results[patched] = (first, second, launches)
            if handle is not None:
                handle.disable()
    finally:  # the shared model gets its default processors back
        for block in (*plain.transformer_blocks, *plain.single_transformer_blocks):
            block.attn.set_processor(type(block.attn)._default_processor_cls())
    (f_first, f_second, f_launches), (e_first, e_second, e_launches) = results[True], results[False]
    assert torch.equal(f_first.sample, e_first.sample) and torch.equal(f_second, e_second)
    assert_same_kv_caches(f_first.kv_cache, e_first.kv_cache)
    assert e_launches == 0 and f_launches == fully_fused


# --------------------------------------------------------------------------- gradients, hooks, compile


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    """Backward passes that give the same bits each run: SDPA's fused backward kernels may sum in a
    different order each run, its math backend does not; other ops take their deterministic forms."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_lora_training_step_equals_diffusers(family: Family, checkpointing: bool, inputs: dict) -> None:
    """A LoRA fine-tuning step on klein-4B: where a gradient is needed the fused sites step aside (the
    ops decline under autograd; with gradient checkpointing the call is diffusers' forward), so the
    loss and every adapter gradient equal diffusers', bit for bit. Run with deterministic backward
    kernels, checked by running diffusers twice."""
    peft = pytest.importorskip("peft")
    model = family.model()
    with torch.random.fork_rng(devices=[CUDA]):
        torch.manual_seed(0)
        model.add_adapter(
            peft.LoraConfig(r=4, init_lora_weights=False, target_modules=list(family.training_targets))
        )
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    results = []
    with _deterministic():
        for patched in (False, True, False):
            handle = enable(model) if patched else None
            model.zero_grad(set_to_none=True)
            loss = model(**inputs).sample.float().square().mean()
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
            results.append((loss.detach(), grads))
            if handle is not None:
                handle.disable()
    del model
    _free()
    (loss, grads), (f_loss, f_grads), (again_loss, again_grads) = results
    assert grads and grads.keys() == f_grads.keys() == again_grads.keys()
    assert torch.equal(loss, again_loss) and all(torch.equal(grads[n], again_grads[n]) for n in grads), (
        "diffusers alone is not deterministic here: the comparison would mean nothing"
    )
    assert torch.equal(f_loss, loss)
    differing = [n for n in grads if not torch.equal(f_grads[n], grads[n])]
    assert not differing, f"{len(differing)} of {len(grads)} adapter gradients differ, first {differing[0]}"


def test_hooks_on_blocks_and_submodules_equal_diffusers(
    family: Family, inputs: dict, fully_fused: int
) -> None:
    """A forward hook on a single block and a pre-hook on a double block's feed-forward: those run as
    diffusers' module calls (the hooks see real tensors), everything else fuses."""
    seen: list[str] = []

    def setup(model: nn.Module) -> None:
        model.single_transformer_blocks[0].register_forward_hook(lambda m, a, o: seen.append("single"))
        model.transformer_blocks[0].ff.register_forward_pre_hook(lambda m, a: seen.append("ff"))

    launches = _patched_vs_diffusers(family, setup, inputs)
    assert "single" in seen and "ff" in seen
    # The hooked single block runs its fused forward under its hook (all its sites fuse); the hooked
    # feed-forward is diffusers' module call, so its activation alone runs eager: 95 of 96 at klein-4B.
    assert launches == fully_fused - 1


def test_torch_compile_of_the_patched_transformer_equals_diffusers(
    plain: nn.Module, inputs: dict, fully_fused: int
) -> None:
    """torch.compile(fullgraph=True) traces the patched forward with the fused sites as flux2_fused
    operators; run by a backend that executes the traced graph as is, each operator launches its
    kernel (as many launches as the eager patched call) and the output is diffusers'."""
    graphs = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    handle = enable(plain)
    torch.compiler.reset()
    try:
        with torch.inference_mode():
            model = torch.compile(plain, fullgraph=True, backend=recording_backend)
            compiled = model(**inputs).sample
            launches = fused_launches(lambda: model(**inputs))
            handle.disable()
            expected = plain(**inputs).sample
    finally:
        handle.disable()
        torch.compiler.reset()
    targets = {node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert torch.ops.flux2_fused.qk_norm_rope.default in targets
    assert torch.ops.flux2_fused.gated_resnorm.default in targets
    assert launches == fully_fused
    assert torch.equal(compiled, expected)


@FLUX2_ONLY
def test_flux2_pipeline_with_an_input_image_equals_diffusers(fully_fused: int) -> None:
    """Flux2Pipeline (guidance embedding) with an input image, whose latents join the image rows as
    reference tokens with their own ids: images equal to the pipeline alone, every call fully fused."""
    config = dataclasses.replace(CONFIG, guidance_embeds=True)
    model = hosts.diffusers_host(config, CUDA, torch.bfloat16, seed=5)
    pipe = hosts.klein_pipeline(diffusers.Flux2Pipeline, model)
    embeds = torch.randn(1, 128, CONFIG.joint_attention_dim, generator=torch.Generator().manual_seed(3))
    call = _call_512(
        pipe, prompt_embeds=embeds.to(CUDA, torch.bfloat16), image=[_image_512()], guidance_scale=4.0
    )
    expected, patched, launches = _alone_then_enabled(pipe, call)
    assert torch.equal(patched, expected) and launches == 2 * fully_fused


# --------------------------------------------------------------------------- FLUX.1

FLUX1_ONLY = pytest.mark.parametrize("family", ["flux1"], indirect=True)


@FLUX1_ONLY
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_flux1_fuses_every_site_bit_exactly(family: Family, dtype: torch.dtype) -> None:
    """FLUX.1 at dev's width, bf16 and fp16 (where the text stream and the single blocks' output are
    clipped, so those updates are materialized): diffusers' output bit for bit, every site fused."""
    model = family.model().to(dtype)
    inputs = {
        k: v.to(dtype) if k.endswith("states") or k == "pooled_projections" else v
        for k, v in family.inputs().items()
    }
    with torch.inference_mode():
        expected = model(**inputs).sample
        handle = enable(model)
        patched = model(**inputs).sample
        launches = fused_launches(lambda: model(**inputs))
        handle.disable()
    assert torch.equal(patched, expected)
    assert launches == family.sites


@FLUX1_ONLY
@pytest.mark.parametrize("pipeline", ["FluxPipeline", "FluxKontextPipeline"])
def test_flux1_pipelines_equal_diffusers(family: Family, pipeline: str, fully_fused: int) -> None:
    """FluxPipeline at 512x512 (1024 image tokens), and FluxKontextPipeline with a reference image
    (its latents join the image rows with their own ids): the same images with and without enable(),
    every transformer call fully fused."""
    model = family.model()
    pipe = flux1.pipeline(model, cls=getattr(diffusers, pipeline))
    prompts = flux1.prompt_embeddings(model, 128)
    extra = {"image": _image_512(), "max_area": 512 * 512} if "Kontext" in pipeline else {}
    expected, patched, launches = _alone_then_enabled(
        pipe, _call_512(pipe, **prompts, **extra, guidance_scale=3.5)
    )
    assert torch.equal(patched, expected)
    if pipeline == "FluxPipeline":
        assert launches == 2 * fully_fused
    else:  # longer sequences, the same sites
        assert launches == 2 * family.sites
