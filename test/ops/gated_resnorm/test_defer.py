"""`defer` leaves a gated update (one term or FLUX.3's two) pending with the verdict it was judged by,
and the `apply` that consumes it checks only what that verdict could not see (the norm's modulation,
one for all rows or one per segment)."""

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


def test_a_two_term_update_is_pending_with_its_own_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """`defer(..., update2=)` asks the two-term guard (never the one-term one) and leaves
    `residual + gate * (update + update2)` pending with both updates; declined, it is that sum."""
    x, update, gate, *_ = _site()
    update2 = torch.randn_like(update)
    asked: list[str] = []
    monkeypatch.setattr(guards, "defer", lambda *a: pytest.fail("a two-term update asks the two-term guard"))
    monkeypatch.setattr(guards, "defer2", lambda *a: asked.append("defer2") or True)
    pending = gated_resnorm.defer(x, update, gate, update2=update2)
    assert asked == ["defer2"]
    assert isinstance(pending, Segment) and pending.deferred == "kernel" and pending.update2 is update2
    assert torch.equal(pending.materialize(), x + gate * (update + update2))
    monkeypatch.setattr(guards, "defer2", lambda *a: False)
    assert torch.equal(gated_resnorm.defer(x, update, gate, update2=update2), x + gate * (update + update2))
    monkeypatch.setattr(guards, "defer2", lambda *a: pytest.fail("a switched-off site asks no guard"))
    declined = gated_resnorm.defer(x, update, gate, update2=update2, enabled=False)
    assert torch.equal(declined, x + gate * (update + update2))


def test_apply_checks_a_two_term_segment_by_its_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """A two-term segment nobody judged gets the two-term gated guard; one deferred with the kernel's
    verdict gets the plain guard on its modulation alone, as a one-term segment does."""
    x, update, gate, scale, shift = _site()
    update2 = torch.randn_like(update)
    asked: list[str] = []
    for name in ("gated", "gated2", "plain"):
        monkeypatch.setattr(guards, name, lambda *a, name=name: asked.append(name) or False)
    expected = gated_resnorm.reference.gated_resnorm(x, update, gate, scale, shift, update2=update2)
    for deferred, guard in ((None, "gated2"), ("kernel", "plain")):
        asked.clear()
        segment = Segment(x, update, gate, deferred, update2=update2)
        out, stream = gated_resnorm.apply([segment], scale, shift, 1e-6, write_residual=True)
        assert asked == [guard]
        assert torch.equal(out, expected[0]) and torch.equal(stream, expected[1])


def test_apply_guards_each_segment_with_its_own_modulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-segment modulation: segment i is guarded with (scale[i], shift[i])."""
    x, update, gate, scale, shift = _site()
    other_scale, other_shift = scale + 1, shift - 1
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    monkeypatch.setattr(guards, "plain", lambda r, sc, sh: seen.append((sc, sh)) or True)
    monkeypatch.setattr(gated_resnorm, "launch", lambda *a, **k: (None, None))
    rows = [Segment(x, update, gate, "kernel"), Segment(x, update, gate, "kernel")]
    gated_resnorm.fused(rows, (scale, other_scale), (shift, other_shift), 1e-6, write_residual=True)
    assert len(seen) == 2
    assert seen[0][0] is scale and seen[0][1] is shift
    assert seen[1][0] is other_scale and seen[1][1] is other_shift


@pytest.mark.parametrize("batched", [True, False], ids=["BTD", "TD"])
def test_rows_of_a_two_term_segment_are_the_same_rows(batched: bool) -> None:
    """`rows(start)` cuts tokens from both updates and a per-token gate alike."""
    gen = torch.Generator().manual_seed(2)
    lead = (2,) if batched else ()
    x, update, update2, gate = (torch.randn(*lead, 5, 8, generator=gen) for _ in range(4))
    segment = Segment(x, update, gate, update2=update2)
    assert torch.equal(segment.rows(3).materialize(), segment.materialize()[..., 3:, :])
