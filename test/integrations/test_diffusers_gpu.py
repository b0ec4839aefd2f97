"""GPU matrix of `enable()` on diffusers' klein-4B (random weights, bf16, 1024 image + 128 text tokens,
batch 2): CPU offloading, quantized linears, every attention backend this machine runs, LoRA adapters
fused and unfused, and the inpainting pipeline. Each output equals diffusers' with the same setup and
no patch, and our kernel launches are counted: where every site is expected to fuse, the count equals
the plain model's (`test_klein_4b_fuses_on_diffusers_modules` checks that one against the sites);
where hooks make some sites module calls, it is printed."""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from flux2_fused.bench import hosts
from flux2_fused.integrations.diffusers import enable
from flux2_fused.models.flux2 import Flux2Config

from .test_diffusers import _fused_launches, _inputs, assert_same_kv_caches, use_kv_processors

pytestmark = pytest.mark.gpu
diffusers = pytest.importorskip("diffusers")
dispatch = pytest.importorskip("diffusers.models.attention_dispatch")

CONFIG = Flux2Config.preset("klein-4b")
CUDA = torch.device("cuda")
Setup = Callable[[nn.Module], object]


def _model() -> nn.Module:
    """A fresh klein-4B on the GPU, the same random weights every time."""
    return hosts.diffusers_host(CONFIG, CUDA, torch.bfloat16, seed=5)


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def inputs() -> dict:
    return _inputs(CONFIG, "cuda", torch.bfloat16, img=1024, txt=128)


@pytest.fixture(scope="module")
def plain(inputs: dict) -> Iterator[nn.Module]:
    """The plain model (no setup), shared by the tests that change only how it is called."""
    model = _model()
    yield model
    del model
    _free()


@pytest.fixture(scope="module")
def fully_fused(plain: nn.Module, inputs: dict) -> int:
    """Our launches in one call of the plain patched model: the count of a call with every site fused."""
    handle = enable(plain)
    with torch.inference_mode():
        plain(**inputs)
        launches = _fused_launches(lambda: plain(**inputs))
    handle.disable()
    assert launches > 0
    return launches


def _outcome(setup: Setup, inputs: dict, enable_at: str | None) -> tuple[torch.Tensor, int]:
    """A fresh model's output after `setup`, with enable() "first", "last" or not at all (None), and
    our launches in one more call."""
    model = _model()
    if enable_at == "first":
        enable(model)
    setup(model)
    if enable_at == "last":
        enable(model)
    with torch.inference_mode():
        out = model(**inputs).sample.cpu()
        return out, _fused_launches(lambda: model(**inputs))


def _patched_vs_diffusers(
    setup: Setup, inputs: dict, patch_first: bool = False, diffusers_fails: tuple[type[Exception], ...] = ()
) -> int:
    """`setup` and enable() (in either order) give the output of `setup` alone; returns our launches
    in one patched call. Skips where diffusers alone raises one of `diffusers_fails` (nothing to match)."""
    try:
        expected, unpatched = _outcome(setup, inputs, None)
    except diffusers_fails as exc:
        pytest.skip(f"diffusers alone fails with this setup here: {type(exc).__name__}: {exc}")
    _free()
    patched, launches = _outcome(setup, inputs, "first" if patch_first else "last")
    _free()
    assert unpatched == 0 and torch.equal(patched, expected)
    return launches


ORDERS = pytest.mark.parametrize("patch_first", [False, True], ids=["setup-then-enable", "enable-then-setup"])


def _klein_pipeline(model: nn.Module) -> object:
    return hosts.klein_pipeline(diffusers.Flux2KleinPipeline, model)


# --------------------------------------------------------------------------- moves


@ORDERS
def test_device_and_dtype_moves_stay_fully_fused(patch_first: bool, inputs: dict, fully_fused: int) -> None:
    """The transformer moved to the CPU in fp32, put in a pipeline there, the pipeline moved to the GPU
    (`pipe.to("cuda")`) and the transformer back to bf16 (`.to(dtype)`), enable() before or after the
    moves: every site fuses on the moved parameters."""

    def setup(model: nn.Module) -> object:
        model.to("cpu", torch.float32)
        pipe = _klein_pipeline(model)
        pipe.to("cuda")
        model.to(torch.bfloat16)
        return pipe

    assert _patched_vs_diffusers(setup, inputs, patch_first) == fully_fused


# --------------------------------------------------------------------------- offloading


@ORDERS
def test_model_cpu_offload_stays_fully_fused(patch_first: bool, inputs: dict, fully_fused: int) -> None:
    """enable_model_cpu_offload puts accelerate's hook on the transformer's forward; the fused forward
    runs inside it whichever comes first."""

    def setup(model: nn.Module) -> object:
        pipe = _klein_pipeline(model)
        pipe.enable_model_cpu_offload(device="cuda")
        return pipe

    assert _patched_vs_diffusers(setup, inputs, patch_first) == fully_fused


@ORDERS
def test_sequential_cpu_offload_equals_diffusers(patch_first: bool, inputs: dict, fully_fused: int) -> None:
    """Sequential offload hooks every leaf module: those sites run as module calls, the rest fuse.
    (Some accelerate and torch versions fail here without the patch, in set_module_tensor_to_device
    re-wrapping a parameter: TypeError from Tensor.new; then there is nothing to compare.)"""

    def setup(model: nn.Module) -> object:
        pipe = _klein_pipeline(model)
        pipe.enable_sequential_cpu_offload(device="cuda")
        return pipe

    launches = _patched_vs_diffusers(setup, inputs, patch_first, diffusers_fails=(TypeError,))
    order = "enable first" if patch_first else "offload first"
    print(f"sequential offload ({order}): {launches} fused launches of {fully_fused}")
    assert 0 < launches <= fully_fused


@ORDERS
@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_group_offload_equals_diffusers(
    offload_type: str, patch_first: bool, inputs: dict, fully_fused: int
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

    launches = _patched_vs_diffusers(setup, inputs, patch_first)
    print(f"group offload {offload_type}: {launches} fused launches of {fully_fused}")
    assert launches <= fully_fused


# --------------------------------------------------------------------------- quantized linears


@pytest.mark.parametrize("config_name", ["Int8WeightOnlyConfig", "Float8WeightOnlyConfig"])
def test_torchao_weight_only_stays_fully_fused(config_name: str, inputs: dict, fully_fused: int) -> None:
    quantization = pytest.importorskip("torchao.quantization")
    if config_name.startswith("Float8") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs sm_89 or newer")

    def setup(model: nn.Module) -> None:
        quantization.quantize_(model, getattr(quantization, config_name)())

    assert _patched_vs_diffusers(setup, inputs) == fully_fused


def test_bitsandbytes_nf4_equals_diffusers(tmp_path, inputs: dict, fully_fused: int) -> None:
    """NF4 linears loaded through diffusers' BitsAndBytesConfig (from a saved random klein-4B)."""
    pytest.importorskip("bitsandbytes")
    _model().save_pretrained(tmp_path)
    _free()
    quantization = diffusers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    )
    model = diffusers.Flux2Transformer2DModel.from_pretrained(
        tmp_path, quantization_config=quantization, torch_dtype=torch.bfloat16
    )
    with torch.inference_mode():
        expected = model(**inputs).sample
        handle = enable(model)
        patched = model(**inputs).sample
        launches = _fused_launches(lambda: model(**inputs))
        handle.disable()
    print(f"bitsandbytes nf4: {launches} fused launches of {fully_fused}")
    assert torch.equal(patched, expected) and launches > 0


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
            launches = _fused_launches(lambda: plain(**inputs))
    assert torch.equal(patched, expected)
    assert launches == fully_fused


# --------------------------------------------------------------------------- LoRA


@ORDERS
def test_two_adapters_fused_then_unfused_stay_fully_fused(
    patch_first: bool, inputs: dict, fully_fused: int
) -> None:
    pytest.importorskip("peft")

    def setup(model: nn.Module) -> None:
        hosts.add_lora(model, 16, "a", seed=1)
        hosts.add_lora(model, 16, "b", seed=2)
        model.set_adapters(["a", "b"], [0.7, 0.4])
        model.fuse_lora()
        model.unfuse_lora()

    assert _patched_vs_diffusers(setup, inputs, patch_first) == fully_fused


# --------------------------------------------------------------------------- inpainting


def test_klein_inpaint_pipeline_equals_diffusers(fully_fused: int) -> None:
    """Flux2KleinInpaintPipeline at 512x512 (1024 image tokens) with CFG: the same image with and
    without enable(), every transformer call fully fused."""
    from PIL import Image

    pipe = hosts.klein_pipeline(diffusers.Flux2KleinInpaintPipeline, _model())
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

    with torch.inference_mode():
        expected = call()
        handle = enable(pipe)
        patched = call()
        launches = _fused_launches(call)
        handle.disable()
    assert torch.equal(patched, expected)
    assert launches == 3 * 2 * fully_fused  # strength 0.75 of 4 steps: 3 steps, two calls each (CFG)


# --------------------------------------------------------------------------- KV-cache editing


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
                launches = _fused_launches(again)
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
