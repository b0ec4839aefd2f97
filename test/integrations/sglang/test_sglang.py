"""sglang's FLUX.2 DiT as a host: patched vs unpatched vs diffusers, bit for bit; the fallbacks; the
plugin route. Runs where sglang (0.5.x) is importable (CI installs it without its dependencies, see
.ci/run); the GPU tests run on the device with sglang's files carried."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch

from flux2_fused.bench import hosts
from flux2_fused.models.flux2 import Flux2Config, Flux2Transformer, image_ids, text_ids

from ...conftest import count_block_code

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

from flux2_fused.bench import sglang as harness

TINY = Flux2Config.preset("tiny")
N_IMG, N_TXT = 37, 11  # odd counts


@pytest.fixture(scope="module", autouse=True)
def runtime() -> Iterator[None]:
    harness.prepare_runtime(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    yield
    harness.release_runtime()  # later tests (the CLI's torchrun detection) must see no process group
    assert not torch.distributed.is_initialized() and "LOCAL_RANK" not in os.environ


def _reference(
    config: Flux2Config, dtype: torch.dtype, device: str = "cpu", seed: int = 3
) -> torch.nn.Module:
    return hosts.diffusers_model(
        Flux2Transformer.random(config, seed=seed, device=device, dtype=dtype)
    ).eval()


def _inputs(config: Flux2Config, batch: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> dict:
    """Fresh random inputs in diffusers' names; per-batch timesteps (and guidance, where embedded)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(batch, N_IMG, config.in_channels, generator=gen).to(device, dtype),
        "encoder_hidden_states": torch.randn(batch, N_TXT, config.joint_attention_dim, generator=gen).to(
            device, dtype
        ),
        "timestep": torch.rand(batch, generator=gen).to(device),
        "img_ids": image_ids(N_IMG, device=device),
        "txt_ids": text_ids(N_TXT, device=device),
        "guidance": (1 + 4 * torch.rand(batch, generator=gen)).to(device) if config.guidance_embeds else None,
    }


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    return [count_block_code(monkeypatch, f"{kind}_block_body") for kind in ("double", "single")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", ["klein", "dev"])
def test_patched_equals_unpatched_and_diffusers(
    shape: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Klein's shape (no guidance embedder) and dev's (guidance), batch 2, per-batch timesteps: the
    patched DiT runs every block on the block code and equals sglang's own and diffusers' output."""
    config = dataclasses.replace(TINY, guidance_embeds=shape == "dev")
    reference = _reference(config, dtype)
    inputs = _inputs(config, 2, dtype)
    dit = harness.sglang_dit(reference)
    sg_inputs = harness.sglang_inputs(dit, inputs)
    with torch.no_grad():
        expected = reference(**inputs, return_dict=False)[0]
        own = harness.call(dit, sg_inputs)
        counts = _counted(monkeypatch)
        from flux2_fused.integrations.sglang import enable

        handle = enable(dit)
        patched = harness.call(dit, sg_inputs)
    assert [len(c) for c in counts] == [config.num_layers, config.num_single_layers]
    assert torch.equal(own, expected) and torch.equal(patched, expected)
    handle.disable()
    assert "forward" not in dit.__dict__


def test_a_projection_of_strided_rows_is_diffusers_product() -> None:
    """The text rows of a joint [2, 48, 3072] output, projected: diffusers' Linear (weight requiring
    grad) folds them into one product; sglang's Linear (weight not requiring grad) on the same call
    runs a batched one, which on this machine's BLAS gives other bits at this width; the host's
    `linear` gives diffusers' bits, and the module's hooks see the input's own [2, 11, 3072] shape."""
    from flux2_fused.models.flux2.sglang import make_host

    gen = torch.Generator().manual_seed(0)
    joint = torch.randn(2, N_IMG + N_TXT, 3072, generator=gen).bfloat16()
    rows = joint[:, :N_TXT]  # strided: batch stride 48 rows
    diffusers_linear = torch.nn.Linear(3072, 3072, bias=False).bfloat16()
    sglang_linear = SglangStyleLinear(diffusers_linear.weight.detach())
    with torch.no_grad():
        expected = diffusers_linear(rows)
        own = sglang_linear(rows)[0]
        seen = []
        sglang_linear.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))
        ours = make_host().linear(sglang_linear, rows)
    if torch.equal(own, expected):
        pytest.skip("this BLAS gives the batched and the folded product the same bits here")
    assert torch.equal(ours, expected) and ours.shape == (2, N_TXT, 3072)
    assert seen == [(2, N_TXT, 3072)]


class SglangStyleLinear(torch.nn.Module):
    """The call shape of sglang's parallel Linears: F.linear with a weight that does not require
    grad, returning (output, bias)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(x, self.weight), None


def test_klein_width_batch_2_equals_diffusers(monkeypatch: pytest.MonkeyPatch) -> None:
    """klein-4B's width (24 heads of 128) with one block of each kind, bf16, batch 2, 37 + 11 rows:
    the shape where sglang's own batched projections of the strided text and image rows differ from
    diffusers' on the CPU; the patched DiT runs both blocks on the block code and equals diffusers."""
    from flux2_fused.integrations.sglang import enable

    config = dataclasses.replace(Flux2Config.preset("klein-4b"), num_layers=1, num_single_layers=1)
    reference = _reference(config, torch.bfloat16)
    inputs = _inputs(config, 2, torch.bfloat16)
    dit = harness.sglang_dit(reference)
    sg_inputs = harness.sglang_inputs(dit, inputs)
    with torch.no_grad():
        expected = reference(**inputs, return_dict=False)[0]
        enable(dit)
        counts = _counted(monkeypatch)
        patched = harness.call(dit, sg_inputs)
    assert [len(c) for c in counts] == [1, 1]
    assert torch.equal(patched, expected)


def test_rope_tables_are_diffusers() -> None:
    """sglang's half-width tables, each column twice, are diffusers' joint tables value for value."""
    from flux2_fused.models.flux2.sglang import full_width_rope

    reference = _reference(TINY, torch.float32)
    dit = harness.sglang_dit(reference)
    ids = torch.cat([text_ids(N_TXT), image_ids(N_IMG)])
    ours = full_width_rope(dit.rotary_emb(ids))
    theirs = reference.pos_embed(ids)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def _fallback_case(monkeypatch: pytest.MonkeyPatch, change) -> None:
    """After `change(dit, inputs)`, the patched call runs no block code and equals sglang's own."""
    from flux2_fused.integrations.sglang import enable

    reference = _reference(TINY, torch.bfloat16)
    dit = harness.sglang_dit(reference)
    sg_inputs = harness.sglang_inputs(dit, _inputs(TINY, 2, torch.bfloat16))
    sg_inputs = change(dit, sg_inputs) or sg_inputs
    with torch.no_grad():
        own = harness.call(dit, sg_inputs)
        enable(dit)
        counts = _counted(monkeypatch)
        patched = harness.call(dit, sg_inputs)
    assert [len(c) for c in counts] == [0, 0]
    assert torch.equal(patched, own)


def test_a_hooked_block_runs_sglangs_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    def hook(dit, inputs):
        dit.single_transformer_blocks[1].register_forward_hook(lambda m, a, out: None)

    _fallback_case(monkeypatch, hook)


def test_q_k_norms_of_two_eps_run_sglangs_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prologue fuses q/k norms of one eps only; otherwise it would call sglang's norms next to
    diffusers' RoPE, so the whole call is sglang's own instead."""

    def other_eps(dit, inputs):
        dit.single_transformer_blocks[-1].attn.norm_k.variance_epsilon = 1e-5

    _fallback_case(monkeypatch, other_eps)


def test_a_wrapped_linear_layer_still_runs_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Projections are called as modules: a forward hook on one (as a LoRA or offload wrapper adds)
    runs, inside the block code."""
    from flux2_fused.integrations.sglang import enable

    reference = _reference(TINY, torch.bfloat16)
    dit = harness.sglang_dit(reference)
    inputs = _inputs(TINY, 1, torch.bfloat16)
    seen = []
    dit.transformer_blocks[0].attn.to_q.register_forward_hook(lambda m, a, out: seen.append(1))
    with torch.no_grad():
        enable(dit)
        counts = _counted(monkeypatch)
        out = harness.call(dit, harness.sglang_inputs(dit, inputs))
        expected = reference(**inputs, return_dict=False)[0]
    assert seen == [1] and [len(c) for c in counts] == [TINY.num_layers, TINY.num_single_layers]
    assert torch.equal(out, expected)


def test_a_biased_output_projection_runs_sglangs_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A double block's output projections get strided rows at batch > 1, where a bias would be added
    after diffusers' folded product: not the host's product (FLUX.2 has no such bias), so the call is
    sglang's own."""

    def biased(dit, inputs):
        out = dit.transformer_blocks[0].attn.to_add_out
        out.bias = torch.nn.Parameter(
            torch.rand(out.weight.shape[0]).to(out.weight.dtype), requires_grad=False
        )

    _fallback_case(monkeypatch, biased)


def test_a_cache_container_runs_sglangs_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block list swapped for another container (cache-dit's cached blocks) decides which blocks
    run: that call is sglang's own forward."""

    class Container(torch.nn.ModuleList):
        pass

    def cached(dit, inputs):
        dit.single_transformer_blocks = Container(dit.single_transformer_blocks)

    _fallback_case(monkeypatch, cached)


def test_attention_arguments_run_sglangs_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    def masked(dit, inputs):
        return {**inputs, "joint_attention_kwargs": {"attn_mask": None, "scale": 1.0}}

    _fallback_case(monkeypatch, masked)


def test_quantized_or_parallel_models_run_sglangs_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    from flux2_fused.models.flux2 import sglang as binding

    def quantized(dit, inputs):
        dit.quant_config = object()

    _fallback_case(monkeypatch, quantized)
    monkeypatch.setattr(binding, "_one_rank", lambda: False)
    _fallback_case(monkeypatch, lambda dit, inputs: None)


def test_the_host_refuses_diffusers_calls_of_sglang_blocks() -> None:
    """The fallbacks inside the block code pass diffusers' arguments; for sglang's blocks the host
    refuses them (the binding's whole-model check keeps the block code from reaching them)."""
    from flux2_fused.models.flux2.sglang import make_host

    dit = harness.sglang_dit(_reference(TINY, torch.float32))
    host = make_host()
    with pytest.raises(RuntimeError, match="diffusers' arguments"):
        host.call(dit.transformer_blocks[0], hidden_states=None)
    assert host.rms_norm(dit.transformer_blocks[0].attn.norm_q) is not None
    assert host.rms_norm(torch.nn.RMSNorm(16)) is None


def test_enable_tells_the_two_hosts_apart() -> None:
    """Both classes are called Flux2Transformer2DModel: each enable takes its own and refuses the other."""
    from flux2_fused.integrations import diffusers as diffusers_host
    from flux2_fused.integrations import sglang as sglang_host

    reference = _reference(TINY, torch.float32)
    dit = harness.sglang_dit(reference)
    with pytest.raises(TypeError, match="sglang"):
        sglang_host.enable(reference)
    with pytest.raises(TypeError):
        diffusers_host.enable(dit)
    handle = sglang_host.enable(dit)
    assert sglang_host.enable(dit) is handle and "sglang" in repr(handle)


PLUGIN_SCRIPT = textwrap.dedent(
    """
    import dataclasses, sys, torch
    from flux2_fused.bench import sglang as harness, hosts
    from flux2_fused.models.flux2 import Flux2Config, Flux2Transformer, blocks, image_ids, text_ids
    device = torch.device(sys.argv[1])
    harness.prepare_runtime(device)
    from sglang.multimodal_gen.runtime.platforms import plugins
    plugins.load_plugins()
    plugins.apply_plugin_hooks()
    calls = []
    real = blocks.double_block_body
    blocks.double_block_body = lambda *a, **k: calls.append(1) or real(*a, **k)
    config = Flux2Config.preset("tiny")
    weights = Flux2Transformer.random(config, seed=3, device=device, dtype=torch.bfloat16)
    reference = hosts.diffusers_model(weights).eval()
    dit = harness.sglang_dit(reference)
    gen = torch.Generator().manual_seed(0)
    rows = lambda n, width: torch.randn(2, n, width, generator=gen).bfloat16().to(device)
    inputs = dict(
        hidden_states=rows(37, config.in_channels),
        encoder_hidden_states=rows(11, config.joint_attention_dim),
        timestep=torch.rand(2, generator=gen).to(device), img_ids=image_ids(37, device=device),
        txt_ids=text_ids(11, device=device), guidance=torch.tensor([3.5, 2.0], device=device),
    )
    with torch.no_grad():
        out = harness.call(dit, harness.sglang_inputs(dit, inputs))
        expected = reference(**inputs, return_dict=False)[0]
    assert "forward" not in dit.__dict__, "the plugin patched the class, not the instance"
    assert len(calls) == config.num_layers, calls
    assert torch.equal(out, expected)
    print("PLUGIN-OK")
    """
)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_installed_plugin_fuses_every_dit_sglang_builds(device: str) -> None:
    """sglang's own plugin loading (entry point group sglang.multimodal_gen.plugins) finds the
    package's plugin; a DiT built afterwards runs the block code, with no enable() and no flag, and
    equals diffusers (on a GPU with the fused kernels, where sglang's own path differs). In a
    subprocess: the hook patches sglang's class for the whole process."""
    done = subprocess.run(
        [sys.executable, "-c", PLUGIN_SCRIPT, device],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert "PLUGIN-OK" in done.stdout, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("config_name", ["klein-4b", "dev"])
def test_sglang_on_the_gpu_equals_diffusers(config_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At the model's width (its first 2 double and 4 single blocks), bf16, batch 2, per-batch
    timesteps: patched sglang == diffusers eager, bit for bit, every block on the block code, while
    sglang's own GPU path is allowed to differ (it does: its RoPE and QK-norm paths)."""
    config = dataclasses.replace(Flux2Config.preset(config_name), num_layers=2, num_single_layers=4)
    reference = _reference(config, torch.bfloat16, "cuda")
    inputs = _inputs(config, 2, torch.bfloat16, "cuda")
    counts = _counted(monkeypatch)
    result = harness.compare(reference, inputs, rounds=0)
    assert [len(c) for c in counts] == [2 * 2, 2 * 4]  # the patched sglang and diffusers + enable()
    assert result["sglang + enable()"]["bit_exact"] and result["diffusers + enable()"]["bit_exact"]
