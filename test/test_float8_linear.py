"""torchao float8 Linears through the host's `linear` (CPU, where torchao's scaled GEMM runs too):
the output is torchao's own call's bit for bit, per row and per tensor, with and without a bias, for
[B, S, K] and [M, K] inputs; one activation read by three Linears is quantized once; recipes torchao
quantizes otherwise (value bounds, mslk's kernel, another float8 type), wrapped or hooked Linears and
calls under the kill switch or with autograd run the module's own call."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from flux2_fused import float8_linear
from flux2_fused.host import ModuleHost
from flux2_fused.ops import float8_quant

float8 = pytest.importorskip("torchao.quantization.quantize_.workflows.float8.float8_tensor")
granularity_module = pytest.importorskip("torchao.quantization.granularity")
inference = pytest.importorskip("torchao.float8.inference")
BF16 = torch.bfloat16


def _granularity(kind: str) -> Any:
    return granularity_module.PerRow() if kind == "row" else granularity_module.PerTensor()


def _linear(kind: str = "row", bias: bool = True, seed: int = 0, **kwargs: Any) -> nn.Linear:
    """An nn.Linear quantized as `quantize_(Float8DynamicActivationFloat8WeightConfig(granularity))`
    leaves it (`to_float8`)."""
    torch.manual_seed(seed)
    return to_float8(nn.Linear(64, 48, bias=bias).to(BF16), kind, **kwargs)


def to_float8(module: nn.Linear, kind: str = "row", **kwargs: Any) -> nn.Linear:
    """`module` with the weight `quantize_(Float8DynamicActivationFloat8WeightConfig(granularity))`
    gives it (its `Float8Tensor.from_hp` call, done here directly: `quantize_` needs a GPU)."""
    granularity = _granularity(kind)
    preference = kwargs.pop("kernel_preference", float8.KernelPreference.AUTO)
    act = float8.QuantizeTensorToFloat8Kwargs(
        torch.float8_e4m3fn, granularity, kernel_preference=preference, **kwargs
    )
    weight = float8.Float8Tensor.from_hp(
        module.weight.detach(),
        float8_dtype=torch.float8_e4m3fn,
        granularity=granularity,
        mm_config=inference.Float8MMConfig(use_fast_accum=True),
        kernel_preference=preference,
        act_quant_kwargs=act,
    )
    module.weight = nn.Parameter(weight, requires_grad=False)
    return module


def _x(*shape: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 3).to(BF16)


HOST = ModuleHost(frozenset())


@pytest.fixture(params=["direct", "wrapped"])
def gemm(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each GEMM path in turn: torchao 0.18's torch branch called directly, or (with another torchao
    version) the quantized input wrapped and sent through `F.linear`. Counts the `F.linear` calls
    that reach torchao's dispatch, so a test can see which path ran."""
    import torchao

    if request.param == "wrapped":
        monkeypatch.setattr(torchao, "__version__", "0.99.0")
    calls: list[int] = []
    original = float8_linear.F.linear
    monkeypatch.setattr(float8_linear.F, "linear", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@pytest.mark.parametrize("shape", [(2, 7, 64), (9, 64)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", ["row", "tensor"])
def test_the_output_is_torchaos_own(kind: str, bias: bool, shape: tuple[int, ...], gemm: list[int]) -> None:
    module, x = _linear(kind, bias), _x(*shape)
    with torch.inference_mode():
        expected = module(x)
        calls = len(gemm)
        assert float8_linear.linear(module, x) is not None
        assert len(gemm) - calls == (0 if float8_linear._direct_gemm(module.weight, kind) else 1)
        assert torch.equal(HOST.linear(module, x), expected)


def test_torchao_018_takes_the_direct_gemm_for_row_and_tensor_weights() -> None:
    import torchao

    assert torchao.__version__.startswith("0.18.")
    assert float8_linear._direct_gemm(_linear("row").weight, "row")
    assert float8_linear._direct_gemm(_linear("tensor").weight, "tensor")


def test_only_the_branch_mirrored_is_called_directly() -> None:
    """Weights scaled otherwise than the activation's granularity (a 128x128 block scale, a per-row
    weight for a per-tensor activation) and torchao versions other than 0.18 go through torchao's
    dispatch."""
    import torchao

    weight = _linear("row").weight
    assert not float8_linear._direct_gemm(weight, "tensor")
    weight.block_size = [128, 128]
    assert not float8_linear._direct_gemm(weight, "row")
    weight = _linear("tensor").weight
    assert not float8_linear._direct_gemm(weight, "row")
    version, torchao.__version__ = torchao.__version__, "0.19.0"
    try:
        assert not float8_linear._direct_gemm(weight, "tensor")
    finally:
        torchao.__version__ = version


def test_one_activation_read_by_three_linears_is_quantized_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside `shared(x)` (a block's q, k and v projections) x is quantized once; outside, each call
    quantizes its input."""
    calls: list[str] = []
    original = float8_quant.apply
    monkeypatch.setattr(float8_quant, "apply", lambda x, g: calls.append(g) or original(x, g))
    modules, x = [_linear(seed=i) for i in range(3)], _x(2, 7, 64)
    with torch.inference_mode():
        expected = [m(x) for m in modules]
        with float8_linear.shared(x):
            got = [HOST.linear(m, x) for m in modules]
            HOST.linear(modules[0], x.clone())  # another tensor: its own quantization
        assert calls == ["row", "row"]
        HOST.linear(modules[0], x)
        assert calls == ["row", "row", "row"]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_a_scope_is_its_threads_and_keeps_nothing_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another thread's Linears on the same tensor quantize it themselves, and once the scope ends x
    is not held (a later change to x in place is read anew)."""
    import threading

    calls: list[str] = []
    original = float8_quant.apply
    monkeypatch.setattr(float8_quant, "apply", lambda x, g: calls.append(g) or original(x, g))
    module, x = _linear(), _x(2, 7, 64)
    with torch.inference_mode():
        with float8_linear.shared(x):
            HOST.linear(module, x)
            worker = threading.Thread(target=lambda: HOST.linear(module, x))
            worker.start()
            worker.join()
            HOST.linear(module, x)
        assert calls == ["row", "row"]  # this thread's once, the other thread's once
        assert getattr(float8_linear._scope, "current", None) is None
        x.mul_(2.0)
        assert torch.equal(HOST.linear(module, x), module(x))


@pytest.mark.parametrize(
    "recipe",
    [
        {"hp_value_ub": 1200.0},
        {"kernel_preference": "MSLK"},
    ],
    ids=["value bound", "mslk"],
)
def test_recipes_torchao_quantizes_otherwise_run_the_module(recipe: dict) -> None:
    recipe = dict(recipe)
    if recipe.get("kernel_preference") == "MSLK":
        recipe["kernel_preference"] = float8.KernelPreference.MSLK
        module = _linear()
        module.weight.act_quant_kwargs.kernel_preference = float8.KernelPreference.MSLK
    else:
        module = _linear(**recipe)
    assert float8_linear.linear(module, _x(2, 7, 64)) is None


def test_recipes_torchao_would_compute_otherwise_are_its_own_call() -> None:
    """PerRow over another dim than the last (torchao scales the activation across tokens then), the
    EMULATED preference (torchao's GEMM refuses it) and a weight whose preference is not its
    recipe's (torchao picks the GEMM by the weight's): torchao's own call, and no quantized input."""
    across_tokens = _linear()
    across_tokens.weight.act_quant_kwargs.granularity = granularity_module.PerRow(1)
    emulated = _linear(kernel_preference=float8.KernelPreference.EMULATED)
    mismatched = _linear(kernel_preference=float8.KernelPreference.TORCH)
    mismatched.weight.kernel_preference = float8.KernelPreference.AUTO
    for module in (across_tokens, emulated, mismatched):
        assert float8_linear.linear(module, _x(2, 7, 64)) is None
        assert HOST.float8_input(module) is None
    assert HOST.float8_input(_linear(kernel_preference=float8.KernelPreference.TORCH)) == "row"


def test_mslk_installed_with_auto_preference_runs_the_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """With mslk installed torchao quantizes PerRow activations with mslk's Triton kernel (other
    arithmetic): the module's own call. PerTensor stays on torchao's torch path."""
    import torchao.utils

    monkeypatch.setattr(torchao.utils, "_is_mslk_available", lambda: True)
    assert float8_linear.linear(_linear("row"), _x(2, 7, 64)) is None
    assert float8_linear.linear(_linear("tensor"), _x(2, 7, 64)) is not None


def test_wrapped_linears_autograd_and_the_kill_switch_run_the_module(monkeypatch: pytest.MonkeyPatch) -> None:
    module, x = _linear(), _x(2, 7, 64)
    seen: list[int] = []
    handle = module.register_forward_hook(lambda *_: seen.append(1))
    with torch.inference_mode():
        HOST.linear(module, x)
    assert seen == [1]  # the hook ran: the module's own call
    handle.remove()
    assert float8_linear.linear(module, x.float()) is None  # another dtype: torchao's call decides
    assert float8_linear.linear(module, x.clone().requires_grad_()) is None
    monkeypatch.setenv("FLUX2_FUSED_DISABLE", "1")
    assert float8_linear.linear(module, x) is None


def test_a_plain_weight_runs_the_module() -> None:
    module = nn.Linear(64, 48).to(BF16)
    assert float8_linear.linear(module, _x(2, 7, 64)) is None


def test_a_weight_changed_after_a_call_is_read_anew(gemm: list[int]) -> None:
    """The bare weight kept for a Linear is re-made when the weight's config or tensors change (a
    user switching fast accumulation off, or loading other float8 data): torchao's output each time."""
    module, x = _linear(), _x(2, 7, 64)
    with torch.inference_mode():
        assert torch.equal(HOST.linear(module, x), module(x))
        module.weight.mm_config = inference.Float8MMConfig(use_fast_accum=False)
        assert torch.equal(HOST.linear(module, x), module(x))
        other = _linear(seed=5).weight
        module.weight.qdata, module.weight.scale = other.qdata, other.scale
        assert torch.equal(HOST.linear(module, x), module(x))


def _quantized(x: torch.Tensor, kind: str = "row", seen: list[int] | None = None) -> float8_linear.Quantized:
    """x as a kernel's quantizing epilogue hands it over: torchao's quantization of x, and x again
    from `dense()` (counted in `seen`)."""
    q, scale = float8_quant.reference.quantize(x, kind)
    calls = [] if seen is None else seen
    return float8_linear.Quantized(q, scale, kind, x.dtype, lambda: calls.append(1) or x)


@pytest.mark.parametrize("kind", ["row", "tensor"])
def test_a_quantized_input_is_torchaos_call_on_its_values(kind: str, gemm: list[int]) -> None:
    """A `Quantized` input of the Linear's granularity is used as it came (nothing quantized again,
    its values never computed); the output is torchao's call on the activation."""
    module, x, seen = _linear(kind), _x(2, 7, 64), []
    with torch.inference_mode():
        expected = module(x)
        original = float8_quant.apply
        float8_quant.apply = lambda *a: pytest.fail("quantized again")
        try:
            got = HOST.linear(module, _quantized(x, kind, seen))
        finally:
            float8_quant.apply = original
    assert torch.equal(got, expected) and seen == []


def test_a_quantized_input_another_call_needs_is_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the call cannot use the quantization (another granularity, a hooked Linear, the kill
    switch) the activation is computed and the call runs on it: torchao's output each time."""
    x, seen = _x(2, 7, 64), []
    with torch.inference_mode():
        tensor = _linear("tensor")
        assert torch.equal(HOST.linear(tensor, _quantized(x, "row", seen)), tensor(x))
        hooked = _linear("row")
        hooked.register_forward_hook(lambda *_: None)
        assert torch.equal(HOST.linear(hooked, _quantized(x, "row", seen)), hooked(x))
        monkeypatch.setenv("FLUX2_FUSED_DISABLE", "1")
        plain = _linear("row")
        assert torch.equal(HOST.linear(plain, _quantized(x, "row", seen)), plain(x))
    assert seen == [1, 1, 1]


def test_float8_input_is_the_granularity_the_host_quantizes_in(monkeypatch: pytest.MonkeyPatch) -> None:
    assert HOST.float8_input(_linear("row")) == "row"
    assert HOST.float8_input(_linear("tensor")) == "tensor"
    assert HOST.float8_input(nn.Linear(64, 48)) is None
    hooked = _linear()
    hooked.register_forward_pre_hook(lambda *_: None)
    assert HOST.float8_input(hooked) is None
    assert HOST.float8_input(_linear(hp_value_ub=1200.0)) is None
    monkeypatch.setenv("FLUX2_FUSED_DISABLE", "1")
    assert HOST.float8_input(_linear("row")) is None


def test_a_trace_reaches_neither_the_kernel_nor_torchaos_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile(fullgraph=True) the host's float8 Linear is the module's own call (traced
    as torchao's), and asking how it quantizes says no, before the recipe (whose probe of installed
    packages a trace cannot follow) is read."""
    module, x = _linear(), _x(2, 7, 64)
    recipe = float8_linear._recipe

    def untraced_recipe(weight: Any) -> Any:
        if torch.compiler.is_compiling():
            raise AssertionError("the recipe was read under a trace")
        return recipe(weight)

    monkeypatch.setattr(float8_linear, "_recipe", untraced_recipe)

    def site(t: torch.Tensor) -> torch.Tensor:
        assert HOST.float8_input(module) is None
        return HOST.linear(module, t)

    torch.compiler.reset()
    try:
        with torch.inference_mode():
            got = torch.compile(site, fullgraph=True, backend="eager")(x)
            assert torch.equal(got, module(x))
    finally:
        torch.compiler.reset()
