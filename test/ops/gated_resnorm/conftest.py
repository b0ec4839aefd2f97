"""Inputs and guard helpers of the gated_resnorm CPU tests (the CUDA stand-ins are test/ops/conftest.py's)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from flux2_fused.ops.gated_resnorm import (
    defer_decline_reason,
    gated_resnorm,
    gated_resnorm_decline_reason,
    guards,
    modnorm,
    modnorm_decline_reason,
)
from flux2_fused.ops.verdicts import TypeReason


def flux2_inputs(
    batch: int = 2,
    tokens: int = 5,
    dim: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    *,
    chunked: bool = True,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """(residual, update, gate, scale, shift) for one FLUX.2 site, random normal values.

    Streams are contiguous [B, T, D]. With `chunked` the modulation rows are what FLUX.2 passes:
    strided [B, 1, D] views of one [B, 1, 6D] tensor (their data pointers are 8-byte aligned only
    when D % 4 == 0); otherwise each is its own contiguous [B, 1, D] tensor.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    residual, update = randn(batch, tokens, dim), randn(batch, tokens, dim)
    if chunked:
        shift, scale, gate = randn(batch, 1, 6 * dim).chunk(6, dim=-1)[:3]
    else:
        shift, scale, gate = (randn(batch, 1, dim) for _ in range(3))
    return residual, update, gate, scale, shift


def flux3_inputs(
    batch: int = 2,
    tokens: int = 5,
    dim: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    *,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """(residual, update, update2, gate, scale, shift) for one FLUX.3 site, random normal values.

    Streams are contiguous [B, T, D] (update: the attention output, update2: the feed-forward's).
    The modulation is what FLUX.3's blocks pass: `torch.chunk(temb_mod, 3, dim=-1)` of a contiguous
    [B, T, 3D] tensor (shift, scale, gate), strided [B, T, D] views with row stride 3D.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    residual, update, update2 = (randn(batch, tokens, dim) for _ in range(3))
    shift, scale, gate = randn(batch, tokens, 3 * dim).chunk(3, dim=-1)
    return residual, update, update2, gate, scale, shift


@dataclass(frozen=True)
class Guard:
    """A public guard with its reason function, argument names, and validated op (defer has none)."""

    names: tuple[str, ...]
    reason: Callable[..., str | None]
    check: Callable[..., bool]
    op: Callable[..., Any] | None


GUARDS = {
    "gated": Guard(
        ("residual", "update", "gate", "scale", "shift"),
        gated_resnorm_decline_reason,
        guards.gated,
        gated_resnorm,
    ),
    "defer": Guard(("residual", "update", "gate"), defer_decline_reason, guards.defer, None),
    "modnorm": Guard(("x", "scale", "shift"), modnorm_decline_reason, guards.plain, modnorm),
    # FLUX.3's two-term update `residual + gate * (update + update2)`. The public reason functions
    # and the validated op take update2 as a keyword, where None means no second update; these
    # take it positionally, so that garbage in its place is judged as garbage (test_guards checks
    # that the public forms agree with them).
    "gated2": Guard(
        ("residual", "update", "update2", "gate", "scale", "shift"),
        guards.gated2.reason,
        guards.gated2,
        lambda r, u, v, g, sc, sh: validated_two_term(r, u, v, g, sc, sh),
    ),
    "defer2": Guard(("residual", "update", "update2", "gate"), guards.defer2.reason, guards.defer2, None),
}


def validated_two_term(*args: Any) -> Any:
    """The validated op with a second update (positional here, so None is judged as garbage)."""
    residual, update, update2, gate, scale, shift = args
    if update2 is None:
        guards.gated2.validate(*args)
    return gated_resnorm(residual, update, gate, scale, shift, update2=update2)


def check_guard(kind: str, args: tuple[Any, ...]) -> str | None:
    """Call one guard every way and check the answers agree; return its reason.

    The reason function returns None or a non-empty str without raising, the public guard returns
    the bool `reason is None`, and for a declined call the validated op raises TypeError (for a
    TypeReason) or ValueError carrying exactly that reason.
    """
    guard = GUARDS[kind]
    reason = guard.reason(*args)
    accepted = guard.check(*args)
    assert isinstance(accepted, bool)
    assert accepted is (reason is None), (kind, reason)
    if reason is not None:
        assert isinstance(reason, str) and reason
        if guard.op is not None:
            error = TypeError if isinstance(reason, TypeReason) else ValueError
            with pytest.raises(error, match=f"^{re.escape('flux2-fused: ' + reason)}$"):
                guard.op(*args)
    return reason
