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
from types import ModuleType

import pytest
import torch

from flux2_fused.ops import runtime, verdicts


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
