"""CPU tests of the guards: every decline reason with its message, the kill switch, the validated ops' errors.

Shape and stride checks come before the device check, so they run on plain CPU tensors through the
public reason functions. The checks after the device check (dtype, devices, autograd, alignment,
hidden size) run on CUDA stand-ins (conftest.as_cuda). A last test reads the module's source and
fails if it holds a decline reason that no case here produces, so a new reason needs a new case.
"""

from __future__ import annotations

import dataclasses
import re
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
from .conftest import GUARDS, check_guard, flux2_inputs, flux3_inputs

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
        "update2": update.clone(),
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


def token_rows(
    kind: str, *, dim: int = D, tokens: int = T, dtype: torch.dtype = BF16, mod_shape: tuple[int, ...] = ()
) -> tuple[Any, ...]:
    """CUDA stand-in arguments with [T, D] streams and modulation rows of `mod_shape` (default [D]:
    no batch strides at all)."""
    shapes = {
        "residual": (tokens, dim),
        "x": (tokens, dim),
        "update": (tokens, dim),
        "update2": (tokens, dim),
    }
    mod_shape = mod_shape or (dim,)
    return tuple(cuda_zeros(*shapes.get(name, mod_shape), dtype=dtype) for name in GUARDS[kind].names)


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
        "gate must be modulation rows [D], [T, D] or [B, T, D] (T: 1 or the tokens), got (1, 2, 1, 8)",
        ValueError,
    ),
    "gate token rows differ": Case(
        "defer",
        lambda: inputs("defer", gate=zeros(B, T - 1, D)),
        "gate has 4 token rows for a stream of 5 (needs one, or one a token)",
        ValueError,
    ),
    "scale 0-d": Case(
        "modnorm",
        lambda: inputs("modnorm", scale=torch.tensor(0.0, dtype=BF16)),
        "scale must be modulation rows [D], [T, D] or [B, T, D] (T: 1 or the tokens), got ()",
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
    "scale token rows on a [T, D] stream": Case(
        "modnorm",
        lambda: inputs("modnorm", x=zeros(T, D), scale=zeros(T + 1, D), shift=zeros(D)),
        "scale has 6 token rows for a stream of 5 (needs one, or one a token)",
        ValueError,
    ),
    "gate [B, D] against [B, T, D]": Case(  # eager aligns the 2 rows with the 5 tokens, and raises
        "gated",
        lambda: inputs("gated", gate=zeros(B, D)),
        "gate has 2 token rows for a stream of 5 (needs one, or one a token)",
        ValueError,
    ),
    "per-token rows against one token": Case(  # eager would broadcast the stream to 5 tokens
        "gated2",
        lambda: inputs(
            "gated2", gate=zeros(B, T, D), **{n: zeros(B, 1, D) for n in ("residual", "update", "update2")}
        ),
        "gate has 5 token rows for a stream of 1 (needs one, or one a token)",
        ValueError,
    ),
    "per-token rows past D 6144": Case(  # kRowMod is built for D up to 6144 (no model is wider)
        "gated2",
        lambda: inputs("gated2", dim=8192, gate=zeros(B, T, 8192)),
        "gate has a row per token, which the kernel takes for D up to 6144, got 8192",
        ValueError,
    ),
    "FLUX.3 gate of another batch": Case(
        "defer2",
        lambda: inputs("defer2", gate=zeros(B + 1, T, 3 * D)[..., 2 * D :]),
        "gate batch 3 does not match the stream batch 2",
        ValueError,
    ),
    "gate row stride": Case(  # batch stride 64 (fine), rows 10 elements apart
        "gated",
        lambda: inputs("gated", gate=zeros(B * 64).as_strided((B, T, D), (64, 10, 1))),
        "gate row stride 10 is not a multiple of 4 elements",
        ValueError,
    ),
    "[T, D] shift row stride": Case(
        "modnorm",
        lambda: inputs("modnorm", shift=zeros(T, D + 2)[:, :D]),
        "shift row stride 10 is not a multiple of 4 elements",
        ValueError,
    ),
    "per-token scale inner stride": Case(
        "gated2",
        lambda: inputs("gated2", scale=zeros(B, T, 2 * D)[..., ::2]),
        "scale has inner stride 2 (needs 1)",
        ValueError,
    ),
    "per-token shift batch stride": Case(
        "gated2",
        lambda: inputs("gated2", shift=zeros(B * (T * D + 2)).as_strided((B, T, D), (T * D + 2, D, 1))),
        "shift batch stride 42 is not a multiple of 4 elements",
        ValueError,
    ),
    # --- the second update
    "update2 None": Case(
        "gated2", lambda: inputs("gated2", update2=None), "update2 is not a tensor", TypeError
    ),
    "update2 shape": Case(
        "defer2",
        lambda: inputs("defer2", update2=zeros(B, T, D)[:, 1:]),
        "update2 shape (2, 4, 8) differs from residual (2, 5, 8)",
        ValueError,
    ),
    "update2 broadcast over the batch": Case(  # eager would broadcast it; the kernel reads rows
        "gated2",
        lambda: inputs("gated2", update2=zeros(1, T, D)),
        "update2 shape (1, 5, 8) differs from residual (2, 5, 8)",
        ValueError,
    ),
    "update2 transposed": Case(
        "gated2",
        lambda: inputs("gated2", update2=zeros(B, D, T).transpose(1, 2)),
        "update2 is not contiguous along its rows (needs strides (..., D, 1))",
        ValueError,
    ),
    "update2 batch stride": Case(
        "defer2",
        lambda: inputs("defer2", update2=zeros(B * (T * D + 2)).as_strided((B, T, D), (T * D + 2, D, 1))),
        "update2 batch stride 42 is not a multiple of 4 elements",
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
    "update2 float16": Case(
        "gated2",
        lambda: inputs("gated2", cuda=True, update2=cuda_zeros(B, T, D, dtype=torch.float16)),
        "update2 is torch.float16, residual is torch.bfloat16 (eager would promote)",
        TypeError,
    ),
    "per-token scale float32": Case(
        "gated2",
        lambda: inputs("gated2", cuda=True, scale=cuda_zeros(B, T, D, dtype=torch.float32)),
        "scale is torch.float32, residual is torch.bfloat16 (eager would promote)",
        TypeError,
    ),
    "update2 on another GPU": Case(
        "defer2",
        lambda: inputs("defer2", cuda=True, update2=cuda_zeros(B, T, D, index=1)),
        "update2 is on cuda:1, residual on cuda:0",
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
    "update2 requires grad": Case(
        "gated2",
        lambda: inputs("gated2", cuda=True, update2=as_cuda(zeros(B, T, D).requires_grad_())),
        "update2 requires grad and the fused kernel has no backward",
        ValueError,
    ),
    "update2 misaligned": Case(
        "defer2",
        lambda: inputs("defer2", cuda=True, update2=as_cuda(misaligned(B, T, D))),
        "update2 data pointer is not 8-byte aligned",
        ValueError,
    ),
    "per-token gate misaligned": Case(
        "gated2",
        lambda: inputs("gated2", cuda=True, gate=as_cuda(misaligned(B, T, D))),
        "gate data pointer is not 8-byte aligned",
        ValueError,
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
    """Inputs the kernel reproduces, as CUDA stand-ins: FLUX.2's and FLUX.3's own, every broadcast
    layout and every per-token one."""
    names = GUARDS[kind].names
    streams = [name for name in names if name in ("residual", "x", "update", "update2")]
    mods = [name for name in names if name not in streams]
    broadcast = {"gate": cuda_zeros(D, dtype=dtype), "scale": cuda_zeros(1, D, dtype=dtype)}
    broadcast["shift"] = cuda_zeros(1, 1, D, dtype=dtype)
    expanded = as_cuda(zeros(1, 1, D, dtype=dtype).expand(B, 1, D))  # batch stride 0
    joint = as_cuda(zeros(B, T + 3, D, dtype=dtype)[:, 3:])  # image rows of the joint stream
    empty = cuda_zeros(B, 0, D, dtype=dtype)
    # FLUX.3: chunks of a [B, T, 3D] tensor (row stride 3D), and the other per-token layouts.
    chunks = dict(
        zip(("shift", "scale", "gate"), zeros(B, T, 3 * D, dtype=dtype).chunk(3, dim=-1), strict=True)
    )
    per_token = {
        "gate": cuda_zeros(T, D, dtype=dtype),  # [T, D]: one row a token, shared by the batch
        "scale": cuda_zeros(1, T, D, dtype=dtype),
        "shift": as_cuda(zeros(1, T, D, dtype=dtype).expand(B, T, D)),  # batch stride 0
    }
    token_expanded = as_cuda(zeros(B, 1, D, dtype=dtype).expand(B, T, D))  # row stride 0
    return {
        "FLUX.2 chunks": inputs(kind, cuda=True, dtype=dtype),
        "FLUX.3 chunks": inputs(kind, cuda=True, dtype=dtype, **{k: as_cuda(chunks[k]) for k in mods}),
        "broadcast rows": inputs(kind, cuda=True, dtype=dtype, **{k: broadcast[k] for k in mods}),
        "per-token rows": inputs(kind, cuda=True, dtype=dtype, **{k: per_token[k] for k in mods}),
        "expanded rows": inputs(kind, cuda=True, dtype=dtype, **dict.fromkeys(mods, expanded)),
        "rows expanded over tokens": inputs(
            kind, cuda=True, dtype=dtype, **dict.fromkeys(mods, token_expanded)
        ),
        "rows of a longer stream": inputs(kind, cuda=True, dtype=dtype, **dict.fromkeys(streams, joint)),
        "[T, D] stream": token_rows(kind, dtype=dtype),
        "[T, D] stream, [T, D] rows": token_rows(kind, dtype=dtype, mod_shape=(T, D)),
        "[T, D] stream, [1, T, D] rows": token_rows(kind, dtype=dtype, mod_shape=(1, T, D)),
        "no tokens": inputs(kind, cuda=True, dtype=dtype, **dict.fromkeys(streams, empty)),
        "no tokens, per-token rows": token_rows(kind, dtype=dtype, tokens=0, mod_shape=(0, D)),
        "one token": token_rows(kind, dtype=dtype, tokens=1, mod_shape=(1, 1, D)),
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
def test_2d_modulation_is_per_token() -> None:
    """Eager aligns a [R, D] gate with the last two axes of [B, T, D]: per token, never per batch.

    With R == T it applies row t to token t of every batch (so does the kernel: the rows are a
    token's), with R == 1 it broadcasts, otherwise it raises. A [B, D] tensor of per-batch rows is
    therefore accepted only where B == T, and then as eager reads it: per token.
    """
    residual, gate = torch.zeros(B, B, D), torch.randn(B, D)
    assert torch.equal((residual + gate)[1, 0], gate[0])  # batch 1 gets row 0: rows are tokens
    assert torch.equal((residual + gate)[0, 1], gate[1])
    with pytest.raises(RuntimeError):
        torch.zeros(B, T, D) + gate  # T != B: eager refuses
    args = (cuda_zeros(B, B, D), cuda_zeros(B, B, D), cuda_zeros(B, D))
    assert defer_decline_reason(*args) is None, f"[{B}, {D}] gate against [{B}, {B}, {D}]: per token"
    args = (cuda_zeros(B, T, D), cuda_zeros(B, T, D), cuda_zeros(B, D))
    assert defer_decline_reason(*args) is not None, f"[{B}, {D}] gate against [{B}, {T}, {D}]"


@pytest.mark.usefixtures("accept_runtime")
def test_public_two_term_forms_agree_with_the_guard() -> None:
    """`gated_resnorm_decline_reason(..., update2=v)`, `defer_decline_reason(..., update2=v)` and the
    validated op with update2 give the two-term guard's reasons (the GUARDS table calls the guard
    itself); update2=None is the one-term site."""
    residual, update, update2, gate, scale, shift = (as_cuda(t) for t in flux3_inputs(B, T, D))
    bad = as_cuda(zeros(B, T - 1, D))
    reason = "update2 shape (2, 4, 8) differs from residual (2, 5, 8)"
    assert gated_resnorm_decline_reason(residual, update, gate, scale, shift, update2=bad) == reason
    assert defer_decline_reason(residual, update, gate, update2=bad) == reason
    with pytest.raises(ValueError, match=re.escape(reason)):
        gated_resnorm.gated_resnorm(residual, update, gate, scale, shift, update2=bad)
    assert gated_resnorm_decline_reason(residual, update, gate, scale, shift, update2=update2) is None
    assert defer_decline_reason(residual, update, gate, update2=update2) is None
    assert gated_resnorm_decline_reason(residual, update, gate, scale, shift) is None
    assert defer_decline_reason(residual, update, gate, update2=None) is None


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
    remembered: dict = {}
    monkeypatch.setattr(verdicts, "_verdicts", remembered)
    stream = GUARDS[kind].names[0]
    aligned = inputs(kind, cuda=True)
    shifted = inputs(kind, cuda=True, **{stream: as_cuda(misaligned(B, T, D))})  # same shape and strides
    grad = inputs(kind, cuda=True, **{stream: as_cuda(zeros(B, T, D).requires_grad_())})
    for _ in range(2):  # the second round answers from the remembered verdict
        assert check_guard(kind, aligned) is None
        assert check_guard(kind, shifted) == f"residual data pointer is not {verdicts.ALIGN}-byte aligned"
        assert check_guard(kind, grad) == "residual requires grad and the fused kernel has no backward"
    assert len(remembered) == 1
    monkeypatch.undo()  # the real runtime stage: the kill switch is read on every call
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert GUARDS[kind].check(*aligned) is False


@pytest.mark.usefixtures("accept_runtime")
def test_remembered_verdicts_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    remembered: dict = {}
    monkeypatch.setattr(verdicts, "_verdicts", remembered)
    monkeypatch.setattr(verdicts, "MAX_VERDICTS", 3)
    for tokens in range(1, 11):
        assert check_guard("modnorm", inputs("modnorm", cuda=True, x=cuda_zeros(B, tokens, D))) is None
        assert 0 < len(remembered) <= 3


def _rows(kind: str) -> tuple[list[Segment], Any, Any, bool]:
    """Segments one launch cannot take with this form of modulation, whatever their tensors: (rows,
    scale, shift, write_residual)."""
    residual, update, gate, scale, shift = inputs("gated", cuda=True)
    gated, plain = Segment(residual, update, gate), Segment(residual)
    two_term = Segment(residual, update, gate, update2=update)
    per_token = cuda_zeros(B, T, D)
    wide, wide_mod = Segment(cuda_zeros(B, T, 8192)), cuda_zeros(B, 1, 8192)
    return {
        "three segments": ([gated, gated, gated], scale, shift, True),
        "mixed": ([gated, plain], scale, shift, True),
        "one- and two-term": ([gated, two_term], scale, shift, True),
        "plain concat written": ([plain, plain], scale, shift, True),
        "2-D concat": ([Segment(residual[0]), Segment(residual[0])], scale, shift, False),
        "batch differs": ([plain, Segment(residual[:1])], scale, shift, False),
        # Each with a modulation of its own dtype, so no segment's own guard ties them together.
        "dtype differs": (
            [plain, Segment(residual.half())],
            (scale, scale.half()),
            (shift, shift.half()),
            False,
        ),
        # Eager would modulate the concat (10 tokens) with these 5 rows, and raise.
        "per-token scale shared": ([two_term, two_term], per_token, shift, True),
        "per-token shift shared": ([plain, plain], scale, per_token, False),
        "tuple and tensor": ([gated, gated], (scale, scale), shift, True),
        "tuple too short": ([gated, gated], (scale,), (shift,), True),
        "tuple too long": ([gated], (scale, scale), (shift, shift), True),
        "per segment past D 6144": ([wide, wide], (wide_mod, wide_mod), (wide_mod, wide_mod), False),
    }[kind]


ROWS_CASES = {
    "three segments": "a launch takes one or two segments, got 3",
    "mixed": "the two segments mix gated and plain rows",
    "one- and two-term": "the two segments mix one- and two-term updates",
    "plain concat written": "the kernel writes no concat of plain rows",
    "2-D concat": "segments to concatenate must be [B, T, D]",
    "batch differs": "the two segments differ in batch",
    "dtype differs": "the two segments differ in hidden size or dtype",
    "per-token scale shared": "a per-token scale shared by two segments (pass one per segment)",
    "per-token shift shared": "a per-token shift shared by two segments (pass one per segment)",
    "tuple and tensor": "scale and shift must both be tensors or both be tuples with one tensor per segment",
    "tuple too short": "per-segment scale and shift need one tensor per segment (2), got 1 and 1",
    "tuple too long": "per-segment scale and shift need one tensor per segment (1), got 2 and 2",
    "per segment past D 6144": "a modulation per segment takes D up to 6144, got 8192",
}


@pytest.mark.parametrize("kind", ROWS_CASES)
@pytest.mark.usefixtures("accept_runtime")
def test_entry_point_declines_what_one_launch_cannot_do(kind: str) -> None:
    """The entry point's own reasons; `fused` then returns None, so the caller runs the eager chain."""
    rows, scale, shift, write_residual = _rows(kind)
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


@pytest.mark.usefixtures("accept_runtime")
def test_entry_point_takes_flux3_sites() -> None:
    """FLUX.3's sites: a mode block's two-term update with per-token chunk modulation, the single
    block's text and image segments with their own modulation (one tuple entry each), the output
    norm's plain rows; and the reasons when a segment's own modulation does not fit its rows."""
    text, image = 7, 37
    r_t, u_t, v_t, g_t, sc_t, sh_t = (as_cuda(t) for t in flux3_inputs(B, text, D, seed=1))
    r_i, u_i, v_i, g_i, sc_i, sh_i = (as_cuda(t) for t in flux3_inputs(B, image, D, seed=2))
    txt, img = Segment(r_t, u_t, g_t, update2=v_t), Segment(r_i, u_i, g_i, update2=v_i)
    assert decline_reason([img], sc_i, sh_i) is None
    assert decline_reason([img], (sc_i,), (sh_i,)) is None  # a tuple of one for one segment
    assert decline_reason([txt, img], (sc_t, sc_i), (sh_t, sh_i)) is None
    assert (
        decline_reason([Segment(r_t), Segment(r_i)], (sc_t, sc_i), (sh_t, sh_i), write_residual=False) is None
    )
    assert decline_reason([Segment(r_i)], sc_i, sh_i) is None
    # Broadcast rows per segment, and one broadcast modulation shared (FLUX.2's single block).
    *_, flux2_scale, flux2_shift = inputs("gated", cuda=True)
    assert decline_reason([txt, img], (flux2_scale, sc_i), (flux2_shift, sh_i)) is None
    assert decline_reason([txt, img], flux2_scale, flux2_shift) is None
    # Each segment is judged with its own rows: the text rows' scale on the image rows declines.
    expected = "scale has 7 token rows for a stream of 37 (needs one, or one a token)"
    assert decline_reason([txt, img], (sc_t, sc_t), (sh_t, sh_i)) == expected
    assert decline_reason([img, txt], (sc_t, sc_i), (sh_t, sh_i)) == expected
    assert (
        decline_reason([txt, img], (sc_t, sc_i), (sh_t, sh_t[..., :4]))
        == "shift has 4 channels, residual has 8"
    )
    # One per-token modulation for the concat (eager's form for a shared one): each segment's guard
    # sees rows that are not its own and declines (the entry point's own reason covers equal counts).
    joint_scale, joint_shift = as_cuda(zeros(B, text + image, D)), as_cuda(zeros(B, text + image, D))
    expected = "scale has 44 token rows for a stream of 7 (needs one, or one a token)"
    assert decline_reason([txt, img], joint_scale, joint_shift) == expected
    two_term_bad = Segment(r_i, u_i, g_i, update2=v_i[:, 1:])
    expected = "update2 shape (2, 36, 8) differs from residual (2, 37, 8)"
    assert decline_reason([txt, two_term_bad], (sc_t, sc_i), (sh_t, sh_i)) == expected
    assert (
        gated_resnorm.fused([txt, two_term_bad], (sc_t, sc_i), (sh_t, sh_i), 1e-6, write_residual=True)
        is None
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_on_the_cpu_is_the_eager_chain(dtype: torch.dtype) -> None:
    """Where the guards decline (here: CPU tensors) `apply` is `reference.segments`, bit for bit."""
    residual, update, gate, scale, shift = flux2_inputs(dtype=dtype)
    r3, u3, v3, g3, sc3, sh3 = flux3_inputs(dtype=dtype)
    sites = [
        ([Segment(residual, update, gate)], scale, shift),
        ([Segment(residual)], scale, shift),
        ([Segment(residual)] * 2, scale, shift),
        ([Segment(r3, u3, g3, update2=v3)], sc3, sh3),
        (
            [Segment(r3, u3, g3, update2=v3), Segment(residual, update, gate, update2=u3)],
            (sc3, scale),
            (sh3, shift),
        ),
    ]
    for rows, sc, sh in sites:
        assert gated_resnorm.fused(rows, sc, sh, 1e-6, write_residual=False) is None
        out, stream = gated_resnorm.apply(rows, sc, sh, 1e-6, write_residual=True)
        ref_out, ref_stream = gated_resnorm.reference.segments(rows, sc, sh)
        assert torch.equal(out, ref_out) and torch.equal(stream, ref_stream)


def test_apply_raises_where_eager_raises() -> None:
    """A malformed modulation is declined by the entry point and raised by the eager chain it falls
    back to, never computed into something eager would not give."""
    residual, update, gate, scale, shift = flux2_inputs()
    rows = [Segment(residual, update, gate)] * 2
    with pytest.raises(TypeError, match="both be tensors or both be tuples"):
        gated_resnorm.apply(rows, (scale, scale), shift, 1e-6, write_residual=True)
    with pytest.raises(TypeError, match="one tensor per segment"):
        gated_resnorm.apply(rows, (scale,), (shift,), 1e-6, write_residual=True)


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


def _comfyui_rows(dim: int = 3072, tokens: int = 5) -> tuple[list, torch.Tensor, torch.Tensor]:
    """One gated segment with ComfyUI's FLUX.2 modulation: strided [B, 1, D] chunk views."""
    residual, update = torch.randn(2, tokens, dim), torch.randn(2, tokens, dim)
    shift, scale, gate = torch.randn(2, 1, 3 * dim).chunk(3, dim=-1)
    return [gated_resnorm.Segment(residual, update, gate)], scale, shift


def _site_with(change: str) -> tuple[list, gated_resnorm.Modulation, gated_resnorm.Modulation]:
    """A FLUX.2 site (`_comfyui_rows`) with one change: per-token scale rows, a per-token gate, a
    second update, another width ("wide" 8192, "other width" 2048), or a modulation per segment."""
    dim = {"wide": 8192, "other width": 2048}.get(change, 3072)
    rows, scale, shift = _comfyui_rows(dim)
    segment = rows[0]
    if change == "per-token":
        scale = torch.randn(2, 5, dim)
    elif change == "per-token gate":
        rows = [gated_resnorm.Segment(segment.residual, segment.update, torch.randn(2, 5, dim))]
    elif change == "update2":
        rows = [gated_resnorm.Segment(segment.residual, segment.update, segment.gate, update2=segment.update)]
    elif change == "per-segment":
        scale, shift = (scale,), (shift,)
    return rows, scale, shift


TWO_TERMS_PER_TOKEN = (
    "the quantizing form takes a two-term update with modulation rows per token (FLUX.3's), not one"
)
# What each change to a FLUX.2 site makes the reason of a narrower form say: ComfyUI's modulation
# rounding (`addcmul_reason`) and the quantizing form (`quantized_form_reason`).
FORM_CASES = {
    ("addcmul", "per-token"): "addcmul modulation takes one modulation row a batch, not per-token rows",
    ("addcmul", "update2"): "addcmul modulation takes one-term updates",
    ("addcmul", "wide"): "addcmul modulation takes D up to 6144, got 8192",
    ("addcmul", "per-segment"): "addcmul modulation takes one scale and shift for every row",
    ("quantized", "other width"): "the quantizing form takes D of 3072, 4096, 6144, got 2048",
    ("quantized", "wide"): "the quantizing form takes D of 3072, 4096, 6144, got 8192",
    ("quantized", "per-token"): TWO_TERMS_PER_TOKEN,
    ("quantized", "per-token gate"): TWO_TERMS_PER_TOKEN,
    ("quantized", "per-segment"): TWO_TERMS_PER_TOKEN,
    (
        "quantized",
        "update2",
    ): "the quantizing form takes a two-term update with modulation rows per token only (FLUX.3's)",
}


@pytest.mark.parametrize(("form", "change"), FORM_CASES)
def test_narrower_forms_decline_what_their_sites_do_not_use(form: str, change: str) -> None:
    """ComfyUI's modulation rounding is built for its FLUX.2 sites, the quantizing form (out as
    torchao's per-row float8) for FLUX.1's, FLUX.2's and FLUX.3's widths: anything else declines
    with a reason, and the caller runs the eager chain (`reference`) or computes out for the Linear
    to quantize."""
    rows, scale, shift = _site_with(change)
    reason = FORM_CASES[form, change]
    if form == "addcmul":
        assert gated_resnorm.addcmul_reason(rows, scale, shift) == reason
        assert gated_resnorm.decline_reason(rows, scale, shift, addcmul=True) == reason
        assert gated_resnorm.addcmul_reason(*_comfyui_rows()) is None
    else:
        assert guards.quantized_form_reason(rows, scale, shift) == reason
        assert gated_resnorm.quantized_reason(rows, scale, shift) == reason
        assert gated_resnorm.quantized(rows, scale, shift, 1e-6, write_residual=True) is None
        assert guards.quantized_form_reason(*_comfyui_rows()) is None


@pytest.mark.parametrize("dim", [3072, 4096, 6144])
def test_the_quantizing_form_takes_flux2s_sites_on_a_gpu_only(dim: int) -> None:
    """A FLUX.2 site (one modulation row a batch, with or without an update, one or two segments)
    is the quantizing form's: on the CPU only the device declines it."""
    rows, scale, shift = _comfyui_rows(dim)
    plain = [gated_resnorm.Segment(rows[0].residual)]
    two = [rows[0], gated_resnorm.Segment(torch.randn(2, 3, dim), torch.randn(2, 3, dim), rows[0].gate)]
    for case in (rows, plain, two):
        _declined_by_the_device_alone(case, scale, shift)


def _declined_by_the_device_alone(
    rows: list, scale: gated_resnorm.Modulation, shift: gated_resnorm.Modulation
):
    assert guards.quantized_form_reason(rows, scale, shift) is None
    assert (
        gated_resnorm.quantized_reason(rows, scale, shift)
        == "tensors are on cpu, the fused kernel needs CUDA"
    )
    assert gated_resnorm.quantized(rows, scale, shift, 1e-6, write_residual=True) is None


def test_the_quantizing_form_takes_flux3s_mode_block_sites_on_a_gpu_only() -> None:
    """FLUX.3's mode block sites (per-token modulation rows: the first block's input rows, then the
    two-term update) are the quantizing form's too: on the CPU only the device declines them."""
    rows, _, _ = _comfyui_rows()
    shift, scale, gate = torch.randn(2, 5, 3 * 3072).chunk(3, dim=-1)
    residual, update = rows[0].residual, rows[0].update
    _declined_by_the_device_alone([gated_resnorm.Segment(residual)], scale, shift)
    _declined_by_the_device_alone(
        [gated_resnorm.Segment(residual, update, gate, update2=update)], scale, shift
    )


def test_the_quantizing_form_takes_flux3s_twin_norms_on_a_gpu_only() -> None:
    """FLUX.3's single block: text and image segments, each with its two-term update and its own
    per-token modulation (chunks of a [B, T, 3D] tensor), into one joint norm."""
    dim = 3072

    def segment(tokens: int) -> tuple[gated_resnorm.Segment, torch.Tensor, torch.Tensor]:
        shift, scale, gate = torch.randn(2, tokens, 3 * dim).chunk(3, dim=-1)
        stream = (torch.randn(2, tokens, dim) for _ in range(3))
        residual, update, update2 = stream
        return gated_resnorm.Segment(residual, update, gate, update2=update2), scale, shift

    (text, c_scale, c_shift), (image, scale, shift) = segment(3), segment(5)
    _declined_by_the_device_alone([text, image], (c_scale, scale), (c_shift, shift))


def test_the_quantizing_forms_reason_follows_its_call() -> None:
    """`quantized_reason` asks what `quantized` asks: two plain segments are the kernel's when it need
    not write their concat (on the CPU the device then declines), and malformed rows get their
    reason rather than an error."""
    rows, scale, shift = _comfyui_rows()
    plain = [gated_resnorm.Segment(rows[0].residual), gated_resnorm.Segment(torch.randn(2, 3, 3072))]
    concat = "the kernel writes no concat of plain rows"
    assert gated_resnorm.quantized_reason(plain, scale, shift) == concat
    assert gated_resnorm.quantized_reason(plain, scale, shift, write_residual=True) == concat
    without = gated_resnorm.quantized_reason(plain, scale, shift, write_residual=False)
    assert without == "tensors are on cpu, the fused kernel needs CUDA"
    assert gated_resnorm.quantized_reason([], scale, shift) == "a launch takes one or two segments, got 0"
    assert gated_resnorm.quantized([], scale, shift, 1e-6, write_residual=True) is None


def test_every_decline_reason_in_the_module_has_a_case() -> None:
    produced = [case.reason for case in CASES.values()] + [reason for _, reason, _ in RUNTIME_CASES.values()]
    produced += list(ROWS_CASES.values()) + list(FORM_CASES.values()) + test_runtime.REASONS
    templates = reason_templates(gated_resnorm, guards, verdicts, runtime)
    assert len(templates) >= 15  # the walk found the reasons at all
    missing = untested(templates, produced)
    assert not missing, f"decline reasons without a test case: {missing}"
