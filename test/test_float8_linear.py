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
    leaves it (its `Float8Tensor.from_hp` call, done here directly: `quantize_` needs a GPU)."""
    torch.manual_seed(seed)
    module = nn.Linear(64, 48, bias=bias).to(BF16)
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


@pytest.mark.parametrize("shape", [(2, 7, 64), (9, 64)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", ["row", "tensor"])
def test_the_output_is_torchaos_own(kind: str, bias: bool, shape: tuple[int, ...]) -> None:
    module, x = _linear(kind, bias), _x(*shape)
    with torch.inference_mode():
        expected = module(x)
        assert float8_linear.linear(module, x) is not None
        assert torch.equal(HOST.linear(module, x), expected)


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


def test_a_weight_changed_after_a_call_is_read_anew() -> None:
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
