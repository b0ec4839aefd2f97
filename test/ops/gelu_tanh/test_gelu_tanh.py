"""CPU tests of the gelu_tanh op: the reference is what diffusers' and torch's tanh GELU modules run,
every decline reason with its message, the validated op's errors, garbage never raises, the fallback
on the CPU, concat, the operator and its trace."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flux2_fused.ops import every_bit_pattern, gelu_tanh, rowwise
from flux2_fused.ops.gelu_tanh import decline_reason, guards, library, reference

from .. import conftest
from ..conftest import as_cuda

activations = pytest.importorskip("diffusers.models.activations")
B, S, H = 2, 5, 8
BF16 = torch.bfloat16
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_the_modules_gelu(dtype: torch.dtype) -> None:
    """diffusers' GELU(approximate="tanh") (FLUX.1's feed-forward: projection, then this) and
    nn.GELU(approximate="tanh") (the single block's act_mlp)."""
    x = (torch.randn(B, S, H) * 6).to(dtype)
    module = activations.GELU(H, H, approximate="tanh").to(dtype)
    assert torch.equal(reference.gelu_tanh(x), module.gelu(x))
    assert torch.equal(reference.gelu_tanh(module.proj(x)), module(x))
    assert torch.equal(reference.gelu_tanh(x), torch.nn.GELU(approximate="tanh")(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_bit_pattern_once(dtype: torch.dtype) -> None:
    """The self-check's exhaustive input: each of the 65536 patterns once."""
    patterns = every_bit_pattern(dtype, "cpu")
    assert patterns.dtype == dtype and patterns.view(torch.int16).unique().numel() == 2**16


def _x(**kw: Any) -> torch.Tensor:
    return as_cuda(torch.zeros(B, S, H, dtype=kw.get("dtype", BF16)))


CASES: dict[str, tuple[tuple[Any, ...], str]] = {
    **conftest.row_cases(H, H),
    "channels": (
        (as_cuda(torch.zeros(B, S, H, dtype=BF16))[..., :6],),
        "x has 6 channels, the kernel needs a positive multiple of 4",
    ),
    "no channels": (
        (as_cuda(torch.zeros(B, S, H, dtype=BF16))[..., :0],),
        "x has 0 channels, the kernel needs a positive multiple of 4",
    ),
    "out shape": (
        (_x(), as_cuda(torch.zeros(B, S, H // 2, dtype=BF16))),
        "out shape (2, 5, 4) is not x's shape",
    ),
}


@pytest.mark.usefixtures("accept_runtime")
def test_accepts_flux1_layouts() -> None:
    """The feed-forward's projection, the single block's MLP projection written into the second half
    of [B, S, D + H], a strided view of a wider projection, and [S, H] rows."""
    dim = 12
    into_joint = as_cuda(torch.zeros(B, S, dim + H, dtype=BF16)[..., dim:])
    strided = as_cuda(torch.zeros(B, S, 3 * H, dtype=BF16)[..., H : 2 * H])
    rows_2d = as_cuda(torch.zeros(S, H, dtype=BF16))
    assert decline_reason(_x()) is None and guards.plain(_x())
    assert decline_reason(_x(), into_joint) is None and guards.into(_x(), into_joint)
    assert decline_reason(strided) is None and guards.plain(strided)
    assert decline_reason(rows_2d, as_cuda(torch.zeros(S, H, dtype=BF16))) is None


QUANTIZED_CASES = conftest.quantized_cases(1)


@pytest.mark.parametrize("name", QUANTIZED_CASES)
@pytest.mark.usefixtures("accept_runtime")
def test_quantized_decline_reason(name: str) -> None:
    conftest.assert_quantized_declines(guards.rows, gelu_tanh, *QUANTIZED_CASES[name])


@pytest.mark.usefixtures("accept_runtime")
def test_quantizing_declines_below_sm_89(monkeypatch: pytest.MonkeyPatch) -> None:
    conftest.assert_quantizing_declines_below_sm_89(guards.rows, gelu_tanh, 1, monkeypatch)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.usefixtures("accept_runtime")
def test_decline_reason_and_validation_error(name: str) -> None:
    """Each reason in words; `fused` declines and the validated op raises TypeError or ValueError."""
    conftest.assert_declines(gelu_tanh, gelu_tanh.gelu_tanh, *CASES[name])


@pytest.mark.parametrize("garbage", [0, "x", torch.tensor(1.0), [1.0]])
@pytest.mark.usefixtures("accept_runtime")
def test_garbage_never_raises(garbage: Any) -> None:
    """In x's place or out's: declined with a reason, never an exception."""
    conftest.assert_garbage_declines(gelu_tanh, garbage, _x(), _x())


@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_on_the_cpu_is_the_eager_op(dtype: torch.dtype) -> None:
    x = (torch.randn(B, S, H) * 4).to(dtype)
    assert gelu_tanh.fused(x) is None
    assert torch.equal(gelu_tanh.apply(x), reference.gelu_tanh(x))
    assert torch.equal(gelu_tanh.apply(x, enabled=False), reference.gelu_tanh(x))
    buffer = torch.zeros(B, S, 2 * H, dtype=dtype)
    assert torch.equal(gelu_tanh.apply(x, out=buffer[..., H:]), reference.gelu_tanh(x))
    assert torch.equal(buffer[..., H:], reference.gelu_tanh(x)) and not buffer[..., :H].any()


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_concat_is_the_single_blocks_cat(dtype: torch.dtype, enabled: bool) -> None:
    """`cat([attn_output, act_mlp(proj_mlp(h))], dim=2)`, FLUX.1's single block."""
    attn = torch.randn(B, S, 12).to(dtype)
    mlp = (torch.randn(B, S, H) * 4).to(dtype)
    joint = gelu_tanh.concat(attn, mlp, enabled=enabled)
    expected = torch.cat([attn, reference.gelu_tanh(mlp)], dim=2)
    assert joint.is_contiguous() and torch.equal(joint, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_library_operator_cpu(dtype: torch.dtype) -> None:
    """opcheck, the reference's values, and its gradient where one is needed."""
    conftest.assert_operator_is_the_reference(
        library.gelu_tanh, reference.gelu_tanh, torch.randn(S, H).to(dtype)
    )


def test_operator_fake_keeps_the_shape() -> None:
    x = torch.empty(B, S, H, device="meta", dtype=BF16)
    out = library.gelu_tanh(x)
    assert out.shape == x.shape and out.dtype == BF16 and out.device.type == "meta"


def test_compile_traces_the_operator_cpu() -> None:
    """Under torch.compile the site is one `flux2_fused.gelu_tanh` node (concat keeps its cat), and
    the graph returns the eager bits."""
    graphs: list[torch.fx.GraphModule] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    def site(prefix: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gelu_tanh.apply(x), gelu_tanh.concat(prefix, x)

    attn, x = torch.randn(B, S, 12), torch.randn(B, S, H) * 4
    torch.compiler.reset()
    with torch.inference_mode():
        plain, joint = torch.compile(site, fullgraph=True, backend=recording_backend)(attn, x)
    (graph,) = graphs
    targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.flux2_fused.gelu_tanh.default) == 2
    assert torch.equal(plain, reference.gelu_tanh(x))
    assert torch.equal(joint, torch.cat([attn, reference.gelu_tanh(x)], dim=-1))


def test_every_decline_reason_has_a_case() -> None:
    produced = [reason for _, reason in (*CASES.values(), *QUANTIZED_CASES.values())] + [conftest.UNBUILT]
    conftest.assert_every_reason_has_a_case(produced, guards, rowwise)
