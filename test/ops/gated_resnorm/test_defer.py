"""`defer` leaves a gated update pending with the verdict it was judged by, and the `apply` that
consumes it checks only what that verdict could not see (the norm's modulation)."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.ops import gated_resnorm
from flux2_fused.ops.gated_resnorm import Segment, guards


def _site() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    x, update = torch.randn(2, 5, 8, generator=gen), torch.randn(2, 5, 8, generator=gen)
    gate, scale, shift = (torch.randn(2, 1, 8, generator=gen) for _ in range(3))
    return x, update, gate, scale, shift


def test_an_accepted_update_is_pending_with_the_kernels_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    x, update, gate, *_ = _site()
    monkeypatch.setattr(guards, "defer", lambda *a: True)
    pending = gated_resnorm.defer(x, update, gate)
    assert isinstance(pending, Segment) and pending.deferred == "kernel"
    assert pending.rows(2).deferred == "kernel"  # rows of it keep the verdict


def test_a_declined_or_disabled_update_is_the_eager_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    x, update, gate, *_ = _site()
    assert torch.equal(gated_resnorm.defer(x, update, gate), x + gate * update)  # CPU: declined
    monkeypatch.setattr(guards, "defer", lambda *a: pytest.fail("a switched-off site asks no guard"))
    assert torch.equal(gated_resnorm.defer(x, update, gate, enabled=False), x + gate * update)


def test_apply_checks_only_the_modulation_of_a_deferred_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gated guard is defer's checks plus the plain guard's on (residual, scale, shift); a
    segment that carries defer's verdict gets the plain guard alone."""
    x, update, gate, scale, shift = _site()
    asked: list[str] = []
    monkeypatch.setattr(guards, "gated", lambda *a: asked.append("gated") or False)
    monkeypatch.setattr(guards, "plain", lambda *a: asked.append("plain") or False)
    expected = gated_resnorm.reference.gated_resnorm(x, update, gate, scale, shift)
    for deferred, guard in ((None, "gated"), ("kernel", "plain")):
        asked.clear()
        out, stream = gated_resnorm.apply(
            [Segment(x, update, gate, deferred)], scale, shift, 1e-6, write_residual=True
        )
        assert asked == [guard]
        assert torch.equal(out, expected[0]) and torch.equal(stream, expected[1])


def test_a_switched_off_site_is_the_eager_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    x, update, gate, scale, shift = _site()
    monkeypatch.setattr(guards, "gated", lambda *a: pytest.fail("a switched-off site asks no guard"))
    out, stream = gated_resnorm.apply(
        [Segment(x, update, gate)], scale, shift, 1e-6, write_residual=True, enabled=False
    )
    expected = gated_resnorm.reference.gated_resnorm(x, update, gate, scale, shift)
    assert torch.equal(out, expected[0]) and torch.equal(stream, expected[1])


@pytest.mark.parametrize("gate_rows", [1, 5], ids=["broadcast-gate", "per-token-gate"])
@pytest.mark.parametrize("batched", [True, False], ids=["BTD", "TD"])
def test_rows_are_the_same_rows_of_the_whole_stream(gate_rows: int, batched: bool) -> None:
    """`rows(start)` cuts tokens (never channels) from the residual, the update and a per-token gate."""
    gen = torch.Generator().manual_seed(1)
    lead = (2,) if batched else ()
    x, update = torch.randn(*lead, 5, 8, generator=gen), torch.randn(*lead, 5, 8, generator=gen)
    gate = torch.randn(*lead, gate_rows, 8, generator=gen)
    segment = Segment(x, update, gate)
    assert torch.equal(segment.rows(2).materialize(), segment.materialize()[..., 2:, :])
