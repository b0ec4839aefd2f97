"""CPU tests of the guards: every decline reason with its message, the kill switch, the validated ops' errors.

Shape and stride checks come before the device check, so they run on plain CPU tensors through the
public reason functions. The checks after the device check (dtype, devices, autograd, alignment,
hidden size) run on CUDA stand-ins (conftest.as_cuda). A last test reads the module's source and
fails if it holds a decline reason that no case here produces, so a new reason needs a new case.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from flux2_fused.ops import DISABLE_ENV, gated_resnorm, jit, kill_switch, runtime, verdicts
from flux2_fused.ops.gated_resnorm import (
    MAX_DIM,
    Segment,
    decline_reason,
    defer_decline_reason,
    gated_resnorm_decline_reason,
    guards,
)
from flux2_fused.ops.verdicts import TypeReason

from .. import test_runtime
from ..conftest import as_cuda, misaligned, reason_templates, untested
from .conftest import GUARDS, check_guard, flux2_inputs

B, T, D = 2, 5, 8
BF16 = torch.bfloat16


def inputs(
    kind: str,
    *,
    cuda: bool = False,
    dim: int = D,
    dtype: torch.dtype = BF16,
    device: str = "cpu",
    **changes: Any,
) -> tuple[Any, ...]:
    """Valid arguments of one guard (CPU tensors, or CUDA stand-ins with `cuda`), some replaced."""
    residual, update, gate, scale, shift = flux2_inputs(B, T, dim, dtype, device)
    wrap = as_cuda if cuda else (lambda t: t)
    base = {
        "residual": residual,
        "x": residual,
        "update": update,
        "gate": gate,
        "scale": scale,
        "shift": shift,
    }
    args = {name: wrap(base[name]) for name in GUARDS[kind].names}
    assert set(changes) <= set(args), f"{kind} takes {tuple(args)}"
    args.update(changes)
    return tuple(args.values())


def zeros(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def cuda_zeros(*shape: int, dtype: torch.dtype = BF16, index: int = 0) -> torch.Tensor:
    return as_cuda(zeros(*shape, dtype=dtype), index)


def token_rows(kind: str, *, dim: int = D, tokens: int = T, dtype: torch.dtype = BF16) -> tuple[Any, ...]:
    """CUDA stand-in arguments with [T, D] streams and [D] modulation rows (no batch strides at all)."""
    shapes = {"residual": (tokens, dim), "x": (tokens, dim), "update": (tokens, dim)}
    return tuple(cuda_zeros(*shapes.get(name, (dim,)), dtype=dtype) for name in GUARDS[kind].names)


@dataclass(frozen=True)
class Case:
    """One declined call: the guard, how to build its arguments, the exact reason and the op's error."""

    kind: str
    args: Callable[[], tuple[Any, ...]]
    reason: str
    error: type[Exception]


CASES: dict[str, Case] = {
    # --- arguments that are not tensors (TypeReason)
    "residual None": Case(
        "gated", lambda: inputs("gated", residual=None), "residual is not a tensor", TypeError
    ),
    "update str": Case(
        "gated", lambda: inputs("gated", update="update"), "update is not a tensor", TypeError
    ),
    "gate int": Case("defer", lambda: inputs("defer", gate=3), "gate is not a tensor", TypeError),
    "scale None": Case("modnorm", lambda: inputs("modnorm", scale=None), "scale is not a tensor", TypeError),
    # --- streams
    "residual 0-d": Case(
        "gated",
        lambda: inputs("gated", residual=torch.tensor(1.0, dtype=BF16)),
        "residual must be [B, T, D] or [T, D], got ()",
        ValueError,
    ),
    "residual 1-d": Case(
        "gated",
        lambda: inputs("gated", residual=zeros(D)),
        "residual must be [B, T, D] or [T, D], got (8,)",
        ValueError,
    ),
    "update 4-d": Case(
        "defer",
        lambda: inputs("defer", update=zeros(1, B, T, D)),
        "update must be [B, T, D] or [T, D], got (1, 2, 5, 8)",
        ValueError,
    ),
    "update shape": Case(
        "gated",
        lambda: inputs("gated", update=zeros(B, T - 1, D)),
        "update shape (2, 4, 8) differs from residual (2, 5, 8)",
        ValueError,
    ),
    "residual transposed": Case(
        "gated",
        lambda: inputs("gated", residual=zeros(T, B, D).transpose(0, 1)),
        "residual is not contiguous along its rows (needs strides (..., D, 1))",
        ValueError,
    ),
    "update inner stride": Case(
        "defer",
        lambda: inputs("defer", update=zeros(B, T, 2 * D)[..., ::2]),
        "update is not contiguous along its rows (needs strides (..., D, 1))",
        ValueError,
    ),
    "update batch stride": Case(
        "gated",
        lambda: inputs("gated", update=zeros(B * (T * D + 2)).as_strided((B, T, D), (T * D + 2, D, 1))),
        "update batch stride 42 is not a multiple of 4 elements",
        ValueError,
    ),
    # --- modulation rows
    "gate 4-d": Case(
        "gated",
        lambda: inputs("gated", gate=zeros(1, B, 1, D)),
        "gate must broadcast over tokens ([D], [1, D] or [B, 1, D]), got (1, 2, 1, 8)",
        ValueError,
    ),
    "gate per token": Case(
        "defer",
        lambda: inputs("defer", gate=zeros(B, T, D)),
        "gate must broadcast over tokens ([D], [1, D] or [B, 1, D]), got (2, 5, 8)",
        ValueError,
    ),
    "scale 0-d": Case(
        "modnorm",
        lambda: inputs("modnorm", scale=torch.tensor(0.0, dtype=BF16)),
        "scale must broadcast over tokens ([D], [1, D] or [B, 1, D]), got ()",
        ValueError,
    ),
    "scale channels": Case(
        "gated",
        lambda: inputs("gated", scale=zeros(B, 1, D + 4)),
        "scale has 12 channels, residual has 8",
        ValueError,
    ),
    "shift batch": Case(
        "gated",
        lambda: inputs("gated", shift=zeros(B + 1, 1, D)),
        "shift batch 3 does not match the stream batch 2",
        ValueError,
    ),
    "scale per token on a [T, D] stream": Case(
        "modnorm",
        lambda: inputs("modnorm", x=zeros(T, D), scale=zeros(T, D), shift=zeros(D)),
        "scale must broadcast over tokens: a 2-D scale is [1, D], got (5, 8) (use [B, 1, D])",
        ValueError,
    ),
    "gate [B, D] against [B, T, D]": Case(
        "gated",
        lambda: inputs("gated", gate=zeros(B, D)),
        "gate must broadcast over tokens: a 2-D gate is [1, D], got (2, 8) (use [B, 1, D])",
        ValueError,
    ),
    "gate inner stride": Case(
        "gated",
        lambda: inputs("gated", gate=zeros(B, 1, 2 * D)[..., ::2]),
        "gate has inner stride 2 (needs 1)",
        ValueError,
    ),
    "scale batch stride": Case(
        "modnorm",
        lambda: inputs("modnorm", scale=zeros(B, 1, D + 2)[..., :D]),
        "scale batch stride 10 is not a multiple of 4 elements",
        ValueError,
    ),
    # --- devices (the first of the common checks, reached with CPU and meta tensors)
    "cpu gated": Case(
        "gated", lambda: inputs("gated"), "tensors are on cpu, the fused kernel needs CUDA", TypeError
    ),
    "cpu modnorm": Case(
        "modnorm", lambda: inputs("modnorm"), "tensors are on cpu, the fused kernel needs CUDA", TypeError
    ),
    "meta defer": Case(
        "defer",
        lambda: inputs("defer", device="meta"),
        "tensors are on meta, the fused kernel needs CUDA",
        TypeError,
    ),
    "meta gated": Case(
        "gated",
        lambda: inputs("gated", device="meta"),
        "tensors are on meta, the fused kernel needs CUDA",
        TypeError,
    ),
    "update on another GPU": Case(
        "gated",
        lambda: inputs("gated", cuda=True, update=cuda_zeros(B, T, D, index=1)),
        "update is on cuda:1, residual on cuda:0",
        TypeError,
    ),
    "shift on cpu": Case(
        "modnorm",
        lambda: inputs("modnorm", cuda=True, shift=zeros(B, 1, D)),
        "shift is on cpu, residual on cuda:0",
        TypeError,
    ),
    # --- dtypes
    "float32": Case(
        "gated",
        lambda: inputs("gated", cuda=True, dtype=torch.float32),
        "dtype torch.float32 is not supported (bfloat16, float16)",
        TypeError,
    ),
    "int16": Case(
        "defer",
        lambda: inputs("defer", cuda=True, dtype=torch.int16),
        "dtype torch.int16 is not supported (bfloat16, float16)",
        TypeError,
    ),
    "gate float16": Case(
        "gated",
        lambda: inputs("gated", cuda=True, gate=cuda_zeros(B, 1, D, dtype=torch.float16)),
        "gate is torch.float16, residual is torch.bfloat16 (eager would promote)",
        TypeError,
    ),
    # --- autograd, alignment, hidden size
    "update requires grad": Case(
        "gated",
        lambda: inputs("gated", cuda=True, update=as_cuda(zeros(B, T, D).requires_grad_())),
        "update requires grad and the fused kernel has no backward",
        ValueError,
    ),
    "update not yet all-reduced": Case(  # tensor parallelism's row-wise output before its wait
        "gated",
        lambda: inputs("gated", cuda=True, update=AsyncCollectiveTensor(cuda_zeros(B, T, D))),
        "update is a AsyncCollectiveTensor; the kernel reads plain tensors only",
        TypeError,
    ),
    "residual misaligned": Case(
        "gated",
        lambda: inputs("gated", cuda=True, residual=as_cuda(misaligned(B, T, D))),
        "residual data pointer is not 8-byte aligned",
        ValueError,
    ),
    "scale misaligned": Case(
        "modnorm",
        lambda: inputs("modnorm", cuda=True, scale=as_cuda(misaligned(B, 1, D))),
        "scale data pointer is not 8-byte aligned",
        ValueError,
    ),
    "D not a multiple of 4": Case(
        "gated",
        lambda: token_rows("gated", dim=6),
        "hidden size 6 is not a positive multiple of 4 (aten would not vectorize)",
        ValueError,
    ),
    "D zero": Case(
        "modnorm",
        lambda: token_rows("modnorm", dim=0, tokens=1),
        "hidden size 0 is not a positive multiple of 4 (aten would not vectorize)",
        ValueError,
    ),
    "D too large": Case(
        "gated",
        lambda: inputs("gated", cuda=True, dim=MAX_DIM + 4),
        "hidden size 16388 exceeds the kernel's maximum 16384",
        ValueError,
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_decline_reason(name: str) -> None:
    """The exact reason; the guard says False; the validated op raises TypeError or ValueError with it."""
    case = CASES[name]
    reason = check_guard(case.kind, case.args())
    assert reason == case.reason
    assert isinstance(reason, TypeReason) == (case.error is TypeError)


def _disable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_ENV, "1")


def _fresh_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "_records", {})
    monkeypatch.setattr(runtime, "_warned", set())


def _capturing(monkeypatch: pytest.MonkeyPatch) -> None:
    _fresh_runtime(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


SELF_CHECK_MISMATCH = "gated, per-batch modulation: out differs from eager"


def _self_check_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    _fresh_runtime(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(jit, "module_for", lambda spec, device: object())
    failing = dataclasses.replace(guards.OP, self_check=lambda device, config: (False, SELF_CHECK_MISMATCH))
    monkeypatch.setattr(guards, "OP", failing)


def _autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *device: True)


# name -> (setup, reason, RuntimeWarnings over repeated calls)
RUNTIME_CASES: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], str, int]] = {
    "kill switch": (_disable, f"disabled by {DISABLE_ENV}", 0),
    "autocast": (_autocast, "autocast is enabled (it changes the dtypes eager computes in)", 0),
    "graph capture before the self-check": (
        _capturing,
        "configuration not yet self-checked, and checking is impossible during CUDA graph capture",
        0,
    ),
    "self-check differs from eager": (_self_check_fails, f"self-check failed: {SELF_CHECK_MISMATCH}", 1),
}


@pytest.mark.parametrize("name", RUNTIME_CASES)
def test_runtime_decline_reason(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs that pass every metadata check, declined by the kill switch or the self-check."""
    setup, expected, warning_count = RUNTIME_CASES[name]
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    setup(monkeypatch)
    args = inputs("gated", cuda=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert gated_resnorm_decline_reason(*args) == expected
            assert guards.gated(*args) is False
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == warning_count, messages
    assert all(
        expected.removeprefix("self-check failed: ") in m and "using eager PyTorch" in m for m in messages
    )


def test_kill_switch_reason_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_ENV, "yes")
    config = gated_resnorm.Config(3072, BF16)
    assert (
        runtime.runtime_reason(guards.OP, torch.device("cuda", 0), config)
        == "disabled by FLUX2_FUSED_DISABLE"
    )


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", " on "])
def test_kill_switch_values_that_disable(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_ENV, value)
    assert kill_switch()


@pytest.mark.parametrize("value", ["", "0", "false", "no", "off", "disable"])
def test_kill_switch_values_that_keep_it_enabled(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_ENV, value)
    assert not kill_switch()


def _accepted_layouts(kind: str, dtype: torch.dtype) -> dict[str, tuple[Any, ...]]:
    """Inputs the kernel reproduces, as CUDA stand-ins: FLUX.2's own and every broadcast layout."""
    names = GUARDS[kind].names
    streams = [name for name in names if name in ("residual", "x", "update")]
    mods = [name for name in names if name not in streams]
    broadcast = {"gate": cuda_zeros(D, dtype=dtype), "scale": cuda_zeros(1, D, dtype=dtype)}
    broadcast["shift"] = cuda_zeros(1, 1, D, dtype=dtype)
    expanded = as_cuda(zeros(1, 1, D, dtype=dtype).expand(B, 1, D))  # batch stride 0
    joint = as_cuda(zeros(B, T + 3, D, dtype=dtype)[:, 3:])  # image rows of the joint stream
    empty = cuda_zeros(B, 0, D, dtype=dtype)
    return {
        "FLUX.2 chunks": inputs(kind, cuda=True, dtype=dtype),
        "broadcast rows": inputs(kind, cuda=True, dtype=dtype, **{k: broadcast[k] for k in mods}),
        "expanded rows": inputs(kind, cuda=True, dtype=dtype, **dict.fromkeys(mods, expanded)),
        "rows of a longer stream": inputs(kind, cuda=True, dtype=dtype, **dict.fromkeys(streams, joint)),
        "[T, D] stream": token_rows(kind, dtype=dtype),
        "no tokens": inputs(kind, cuda=True, dtype=dtype, **dict.fromkeys(streams, empty)),
        "D=4": inputs(kind, cuda=True, dtype=dtype, dim=4),
        "D=max": inputs(kind, cuda=True, dtype=dtype, dim=MAX_DIM),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", GUARDS)
@pytest.mark.usefixtures("accept_runtime")
def test_accepts_what_the_kernel_reproduces(kind: str, dtype: torch.dtype) -> None:
    for layout, args in _accepted_layouts(kind, dtype).items():
        assert check_guard(kind, args) is None, layout


@pytest.mark.usefixtures("accept_runtime")
def test_2d_modulation_broadcasts_over_tokens() -> None:
    """Eager aligns a [R, D] gate with the last two axes of [B, T, D]: per token, never per batch.

    With R == T it applies row t to token t, otherwise it raises; the kernel would apply row b to
    batch b. So a [B, D] row tensor with B > 1 is not a FLUX.2 layout the kernel can reproduce.
    """
    residual, gate = torch.zeros(B, B, D), torch.randn(B, D)
    assert torch.equal((residual + gate)[1, 0], gate[0])  # batch 1 gets row 0: broadcast over batches
    with pytest.raises(RuntimeError):
        torch.zeros(B, T, D) + gate  # T != B: eager refuses
    for tokens in (B, T):
        args = (cuda_zeros(B, tokens, D), cuda_zeros(B, tokens, D), cuda_zeros(B, D))
        assert defer_decline_reason(*args) is not None, f"[{B}, {D}] gate against [{B}, {tokens}, {D}]"


@pytest.mark.usefixtures("accept_runtime")
def test_requires_grad_is_fine_without_grad_mode() -> None:
    """Under no_grad (or inference mode) eager builds no graph either, so the kernel may run."""
    args = inputs("gated", cuda=True, update=as_cuda(zeros(B, T, D).requires_grad_()))
    with torch.no_grad():
        assert guards.gated(*args) is True
    assert guards.gated(*args) is False


@pytest.mark.parametrize("kind", GUARDS)
@pytest.mark.usefixtures("accept_runtime")
def test_remembered_verdict_still_checks_each_call(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guards remember metadata verdicts; what equal metadata does not decide is checked per call:
    data alignment, gradients, the kill switch (and the self-check, via the runtime stage)."""
    monkeypatch.setattr(verdicts, "_verdicts", {})
    stream = GUARDS[kind].names[0]
    aligned = inputs(kind, cuda=True)
    shifted = inputs(kind, cuda=True, **{stream: as_cuda(misaligned(B, T, D))})  # same shape and strides
    grad = inputs(kind, cuda=True, **{stream: as_cuda(zeros(B, T, D).requires_grad_())})
    for _ in range(2):  # the second round answers from the remembered verdict
        assert check_guard(kind, aligned) is None
        assert check_guard(kind, shifted) == f"residual data pointer is not {verdicts.ALIGN}-byte aligned"
        assert check_guard(kind, grad) == "residual requires grad and the fused kernel has no backward"
    assert verdicts.remembered_verdicts() == 1
    monkeypatch.undo()  # the real runtime stage: the kill switch is read on every call
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert GUARDS[kind].check(*aligned) is False


@pytest.mark.usefixtures("accept_runtime")
def test_remembered_verdicts_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verdicts, "_verdicts", {})
    monkeypatch.setattr(verdicts, "MAX_VERDICTS", 3)
    for tokens in range(1, 11):
        assert check_guard("modnorm", inputs("modnorm", cuda=True, x=cuda_zeros(B, tokens, D))) is None
        assert verdicts.remembered_verdicts() <= 3


def _rows(kind: str) -> tuple[list[Segment], bool]:
    """Segments one launch cannot take, whatever their tensors, and the write_residual they go with."""
    residual, update, gate, _, _ = inputs("gated", cuda=True)
    gated, plain = Segment(residual, update, gate), Segment(residual)
    return {
        "three segments": ([gated, gated, gated], True),
        "mixed": ([gated, plain], True),
        "plain concat written": ([plain, plain], True),
        "2-D concat": ([Segment(residual[0]), Segment(residual[0])], False),
        "batch differs": ([plain, Segment(residual[:1])], False),
    }[kind]


ROWS_CASES = {
    "three segments": "a launch takes one or two segments, got 3",
    "mixed": "the two segments mix gated and plain rows",
    "plain concat written": "the kernel writes no concat of plain rows",
    "2-D concat": "segments to concatenate must be [B, T, D]",
    "batch differs": "the two segments differ in batch",
}


@pytest.mark.parametrize("kind", ROWS_CASES)
@pytest.mark.usefixtures("accept_runtime")
def test_entry_point_declines_what_one_launch_cannot_do(kind: str) -> None:
    """The entry point's own reasons; `fused` then returns None, so the caller runs the eager chain."""
    rows, write_residual = _rows(kind)
    _, _, _, scale, shift = inputs("gated", cuda=True)
    assert decline_reason(rows, scale, shift, write_residual=write_residual) == ROWS_CASES[kind]
    assert gated_resnorm.fused(rows, scale, shift, 1e-6, write_residual=write_residual) is None


@pytest.mark.usefixtures("accept_runtime")
def test_entry_point_accepts_one_or_two_guarded_segments() -> None:
    residual, update, gate, scale, shift = inputs("gated", cuda=True)
    gated = Segment(residual, update, gate)
    assert decline_reason([gated], scale, shift) is None
    assert decline_reason([gated, gated], scale, shift) is None
    assert decline_reason([Segment(residual)], scale, shift) is None
    assert decline_reason([gated], scale, shift[..., :4]) == "shift has 4 channels, residual has 8"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_on_the_cpu_is_the_eager_chain(dtype: torch.dtype) -> None:
    """Where the guards decline (here: CPU tensors) `apply` is `reference.segments`, bit for bit."""
    residual, update, gate, scale, shift = flux2_inputs(dtype=dtype)
    for rows in ([Segment(residual, update, gate)], [Segment(residual)], [Segment(residual)] * 2):
        assert gated_resnorm.fused(rows, scale, shift, 1e-6, write_residual=False) is None
        out, stream = gated_resnorm.apply(rows, scale, shift, 1e-6, write_residual=True)
        ref_out, ref_stream = gated_resnorm.reference.segments(rows, scale, shift)
        assert torch.equal(out, ref_out) and torch.equal(stream, ref_stream)


GARBAGE = {
    "None": None,
    "int": 0,
    "float": 1.5,
    "str": "residual",
    "list": [1.0, 2.0],
    "object": object(),
    "0-d tensor": torch.tensor(1.0),
    "1-d tensor": torch.zeros(D),
    "4-d tensor": torch.zeros(1, B, T, D),
}


@pytest.mark.parametrize("garbage", GARBAGE)
@pytest.mark.parametrize("kind", GUARDS)
@pytest.mark.usefixtures("accept_runtime")
def test_guards_return_false_for_garbage(kind: str, garbage: str) -> None:
    """Any one argument replaced by garbage, then all of them: a reason, never True, never an exception.

    The runtime stage accepts, so a False here comes from the metadata checks alone.
    """
    value, count = GARBAGE[garbage], len(GUARDS[kind].names)
    for position in range(count):
        args = list(inputs(kind, cuda=True))
        args[position] = value
        assert check_guard(kind, tuple(args)) is not None, position
    assert check_guard(kind, (value,) * count) is not None


@pytest.mark.parametrize("kind", GUARDS)
def test_guards_never_raise_even_when_checking_does(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guards' last line of defence: an exception while checking declines instead of escaping."""

    def broken(*args: Any, **kwargs: Any) -> str | None:
        raise RuntimeError("bug in a check")

    monkeypatch.setattr(guards, "_metadata_reason", broken)
    monkeypatch.setattr(verdicts, "_verdicts", {})  # no verdict remembered from before
    guard = GUARDS[kind]
    with pytest.raises(RuntimeError, match="bug in a check"):
        guard.reason(*inputs(kind, cuda=True))
    assert guard.check(*inputs(kind, cuda=True)) is False


def test_every_decline_reason_in_the_module_has_a_case() -> None:
    produced = [case.reason for case in CASES.values()] + [reason for _, reason, _ in RUNTIME_CASES.values()]
    produced += list(ROWS_CASES.values()) + test_runtime.REASONS
    templates = reason_templates(gated_resnorm, guards, verdicts, runtime)
    assert len(templates) >= 15  # the walk found the reasons at all
    missing = untested(templates, produced)
    assert not missing, f"decline reasons without a test case: {missing}"
