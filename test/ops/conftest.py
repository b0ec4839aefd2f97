"""Helpers shared by the CPU tests of every op.

The guards read only tensor metadata, so CPU-only CI can reach every check: `as_cuda` wraps a CPU
or meta tensor in a stand-in that reports a CUDA device, while shape, strides, storage offset,
dtype, data pointer and requires_grad stay the wrapped tensor's own. No kernel ever runs on one;
the steps that would need a GPU (kill switch aside: the self-check) are replaced by `accept_runtime`.
"""

from __future__ import annotations

import ast
import inspect
import math
import re
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

from flux2_fused.ops import bits_equal, runtime, self_check_records, verdicts
from flux2_fused.ops.verdicts import TypeReason


class _CudaStandIn(torch.Tensor):
    """A tensor that says it lives on cuda:<index>; see `as_cuda`."""

    # Plain torch semantics for every op (results are ordinary tensors), only `device` differs.
    __torch_function__ = torch._C._disabled_torch_function_impl
    cuda_index: int

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self.cuda_index)


def as_cuda(t: torch.Tensor, index: int = 0) -> torch.Tensor:
    """`t` (same storage, view and grad flag) reporting device cuda:`index` to the guards."""
    out = torch.Tensor._make_subclass(_CudaStandIn, t, t.requires_grad)
    out.cuda_index = index
    return out


def misaligned(*shape: int, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> torch.Tensor:
    """A contiguous tensor whose data pointer sits one element past an aligned allocation."""
    return torch.zeros(math.prod(shape) + 1, dtype=dtype, device=device)[1:].view(shape)


@pytest.fixture(autouse=True)
def stand_ins_are_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guards take only plain tensors (a subclass's data_ptr need not be its values); a stand-in
    shares its wrapped tensor's storage, so here it counts as one."""
    monkeypatch.setattr(verdicts, "PLAIN_TYPES", (*verdicts.PLAIN_TYPES, _CudaStandIn))


@pytest.fixture
def accept_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accept whatever passes the metadata checks: stands in for the kill switch and the self-check."""
    monkeypatch.setattr(runtime, "runtime_reason", lambda op, device, config: None)


@pytest.fixture
def gen() -> torch.Generator:
    """A CUDA generator with a fresh seed: every GPU test draws new data each run."""
    g = torch.Generator(device="cuda")
    g.seed()
    return g


def reason_templates(*modules: ModuleType) -> list[str]:
    """Every message a `*reason` function of these modules can return, as a regex: a test that
    produces each message proves every decline reason has a case."""

    def strings(node: ast.AST | None) -> list[ast.AST]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node]
        if isinstance(node, ast.JoinedStr):
            return [node]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "TypeReason":
            return [s for arg in node.args for s in strings(arg)]
        if isinstance(node, ast.IfExp):
            return strings(node.body) + strings(node.orelse)
        if isinstance(node, ast.BoolOp):
            return [s for value in node.values for s in strings(value)]
        return []

    def regex(node: ast.AST) -> str:
        if isinstance(node, ast.Constant):
            return re.escape(node.value)
        assert isinstance(node, ast.JoinedStr)
        return "".join(re.escape(v.value) if isinstance(v, ast.Constant) else "(.*)" for v in node.values)

    tree = ast.parse("\n".join(inspect.getsource(module) for module in modules))
    functions = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.endswith("reason")
    ]
    returns = [node for fn in functions for node in ast.walk(fn) if isinstance(node, ast.Return)]
    return sorted({regex(s) for r in returns for s in strings(r.value)})


def untested(templates: list[str], produced: list[str]) -> list[str]:
    """The templates no produced message matches."""
    return [t for t in templates if not any(re.fullmatch(t, message) for message in produced)]


def row_cases(channels: int, width: int) -> dict[str, tuple[tuple[Any, ...], str]]:
    """The decline cases of the checks every row-wise op shares (`ops/rowwise.py`), for x of
    [2, 5, channels] and out of [2, 5, width] bf16 rows: name -> (arguments, message). An op adds
    its own: the channel count's and out's shape's messages."""
    b, s, bf16 = 2, 5, torch.bfloat16

    def rows(c: int = channels, **kw: Any) -> torch.Tensor:
        return as_cuda(torch.zeros(b, s, c, dtype=kw.get("dtype", bf16)), kw.get("index", 0))

    batch_strided = torch.zeros(b * s * channels + 2, dtype=bf16).as_strided(
        (b, s, channels), (s * channels + 2, channels, 1)
    )
    joint = torch.zeros(b, s, channels + width, dtype=bf16)  # x and out in one buffer
    return {
        "x not a tensor": ((1.0,), "x is not a tensor"),
        "x 1-D": ((as_cuda(torch.zeros(16, dtype=bf16)),), "x must be [B, S, C] or [S, C], got (16,)"),
        "x inner stride": ((rows(2 * channels)[..., ::2],), "x has inner stride 2 (needs 1)"),
        "x row stride": (
            (rows(channels + 2)[..., 2:],),
            f"x row stride {channels + 2} is not a multiple of 4 elements",
        ),
        "x batch stride": (
            (as_cuda(batch_strided),),
            f"x batch stride {s * channels + 2} is not a multiple of 4 elements",
        ),
        "cpu": ((torch.zeros(b, s, channels, dtype=bf16),), "x is on cpu, the fused kernel needs CUDA"),
        "float32": ((rows(dtype=torch.float32),), "dtype torch.float32 is not supported (bfloat16, float16)"),
        "grad": (
            (as_cuda(torch.zeros(b, s, channels, dtype=bf16).requires_grad_()),),
            "x requires grad and the fused kernel has no backward",
        ),
        "misaligned": ((as_cuda(misaligned(b, s, channels)),), "x data pointer is not 8-byte aligned"),
        "out not a tensor": ((rows(), 3), "out is not a tensor"),
        "out inner stride": ((rows(), rows(2 * width)[..., ::2]), "out has inner stride 2 (needs 1)"),
        "out dtype": (
            (rows(), rows(width, dtype=torch.float16)),
            "out is torch.float16 on cuda:0, x is torch.bfloat16 on cuda:0",
        ),
        "out device": (
            (rows(), rows(width, index=1)),
            "out is torch.bfloat16 on cuda:1, x is torch.bfloat16 on cuda:0",
        ),
        "out in x's storage": (
            (as_cuda(joint[..., :channels]), as_cuda(joint[..., channels:])),
            "out shares storage with x",
        ),
    }


def quantized_cases(operands: int) -> dict[str, tuple[tuple[Any, ...], str]]:
    """The decline cases of the quantizing form's own checks (`RowGuards.quantized_reason`), for an
    op of `operands` operands: name -> ((x, prefix, b), message)."""
    b, s, bf16 = 2, 5, torch.bfloat16

    def rows(c: int, **kw: Any) -> torch.Tensor:
        return as_cuda(torch.zeros(b, s, c, dtype=kw.get("dtype", bf16)))

    x = rows(operands * 8)
    return {
        "joint row not a multiple of 8": (
            (rows(operands * 4), None, None),
            "a joint row of 4 is not a multiple of 8 up to 24576",
        ),
        "joint row too wide": (
            (x, rows(24576), None),
            "a joint row of 24584 is not a multiple of 8 up to 24576",
        ),
        "prefix rows": (
            (x, as_cuda(torch.zeros(b, s + 1, 8, dtype=bf16)), None),
            "prefix shape (2, 6, 8) is not x's rows, a multiple of 4 wide",
        ),
        "prefix width": (
            (x, as_cuda(torch.zeros(b, s, 8, dtype=bf16)[..., :6]), None),
            "prefix shape (2, 5, 6) is not x's rows, a multiple of 4 wide",
        ),
        "prefix dtype": (
            (x, rows(8, dtype=torch.float16), None),
            "prefix is torch.float16 on cuda:0, x is torch.bfloat16 on cuda:0",
        ),
        "prefix inner stride": (
            (x, as_cuda(torch.zeros(b, s, 16, dtype=bf16)[..., ::2]), None),
            "prefix has inner stride 2 (needs 1)",
        ),
        "prefix misaligned": (
            (x, as_cuda(misaligned(b, s, 8)), None),
            "prefix data pointer is not 8-byte aligned",
        ),
    }


UNBUILT = "the quantizing kernel needs sm_89 or newer (float8 GEMMs)"


def assert_quantizing_declines_below_sm_89(
    guards: Any, op: ModuleType, operands: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The quantizing kernel is built for GPUs with float8 GEMMs only: on an older one its guard
    declines with `UNBUILT` (and `verify` skips it), before any self-check could launch it."""
    monkeypatch.setattr(runtime, "capability", lambda device: (8, 0))
    x = as_cuda(torch.zeros(2, 5, operands * 8, dtype=torch.bfloat16))
    assert guards.quantized_reason(x) == UNBUILT
    assert op.quantized(x) is None


def assert_quantized_declines(guards: Any, op: ModuleType, args: tuple, expected: str) -> None:
    """The quantizing form declines (x, prefix, b) with `expected` and its entry point returns None."""
    x, prefix, b = args
    assert guards.quantized_reason(x, prefix, b) == expected
    assert (op.quantized(x, prefix=prefix) if b is None else op.quantized(x, b=b)) is None


def assert_every_reason_has_a_case(produced: list[str], *modules: ModuleType) -> None:
    """Every message the `*reason` functions of `modules` can return matches one of `produced`."""
    templates = reason_templates(*modules)
    assert len(templates) >= 10
    missing = untested(templates, produced)
    assert not missing, f"decline reasons without a test case: {missing}"


def assert_declines(op: ModuleType, validated: Callable[..., Any], args: tuple, expected: str) -> None:
    """`op.decline_reason(*args)` is `expected`, `op.fused` declines, and the validated op raises
    TypeError for a TypeReason, else ValueError, with the reason as its whole message."""
    reason = op.decline_reason(*args)
    assert reason == expected
    assert op.fused(*args) is None
    error = TypeError if isinstance(reason, TypeReason) else ValueError
    with pytest.raises(error, match=f"^{re.escape('flux2-fused: ' + reason)}$"):
        validated(*args)


def assert_garbage_declines(op: ModuleType, garbage: Any, x: torch.Tensor, out: torch.Tensor) -> None:
    """`garbage` in x's place or out's: `op.fused` and `op.decline_reason` decline it with a reason,
    never an exception."""
    for args in ((garbage,), (x, garbage), (garbage, out)):
        assert op.fused(*args) is None
        assert op.decline_reason(*args) is not None


def assert_operator_is_the_reference(
    operator: Callable[[torch.Tensor], torch.Tensor],
    reference: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
) -> None:
    """torch.library.opcheck passes, and the operator returns the reference's values and, on a float32
    leaf, its gradient."""
    torch.library.opcheck(operator, (x,))
    assert torch.equal(operator(x), reference(x))
    leaf = x.float().requires_grad_()
    operator(leaf).sum().backward()
    twin = x.float().requires_grad_()
    reference(twin).sum().backward()
    assert torch.equal(leaf.grad, twin.grad)


def assert_streams_and_graph_capture(op: Callable[[], torch.Tensor], expected: torch.Tensor) -> None:
    """op() (a kernel launch whose configuration is self-checked already) on a side stream, and
    captured in a CUDA graph then replayed over its zeroed output, equals `expected` bit for bit."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = op()
    torch.cuda.current_stream().wait_stream(side)
    assert bits_equal(out, expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = op()
    g_out.fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    assert bits_equal(g_out, expected)


def assert_runs_on_its_tensors_device(
    name: str,
    guard: Callable[[torch.Tensor], bool],
    op: Callable[[torch.Tensor], torch.Tensor],
    reference: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
) -> None:
    """With cuda:0 current and x on another GPU: the guard self-checks the op (`name`) on x's device
    and accepts, and op(x) runs there, leaving cuda:0 current, with the reference's bits."""
    with torch.cuda.device(0):
        assert guard(x)
        records = {key[:3]: record for key, record in self_check_records().items()}
        assert records[(name, str(x.device), str(x.dtype).removeprefix("torch."))].passed
        out = op(x)
        assert torch.cuda.current_device() == 0 and out.device == x.device
        assert bits_equal(out, reference(x))
