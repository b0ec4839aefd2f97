"""uniform_rows on the CPU: its predicate (what the kernel's word means), which views a proof speaks
for and when it stops, and the guards' decline reasons."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from flux2_fused.ops import uniform_rows
from flux2_fused.ops.bits import as_bits
from flux2_fused.ops.uniform_rows import UniformRows, reference
from flux2_fused.ops.verdicts import TypeReason

from ..conftest import as_cuda, misaligned, reason_templates, untested


def _uniform(
    batch: int = 2, rows: int = 5, width: int = 24, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Each batch's rows all its first row, as FLUX.3's modulation Linear gives them."""
    return torch.randn(batch, 1, width).to(dtype).expand(batch, rows, width).contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_the_predicate_compares_bits(dtype: torch.dtype) -> None:
    x = _uniform(dtype=dtype)
    assert reference.differs(x).tolist() == [0]
    assert reference.differs(x[0]).tolist() == [0]  # [S, W]
    flipped = x.clone()
    as_bits(flipped)[1, 4, 23] ^= 1
    assert reference.differs(flipped).tolist() == [1]
    signed = torch.zeros(1, 3, 8, dtype=dtype)
    signed[0, 2, 0] = -0.0
    assert reference.differs(signed).tolist() == [1]  # -0.0 == +0.0 as values, not as bits
    nans = _uniform(dtype=dtype)
    nans[..., 3] = float("nan")
    assert reference.differs(nans).tolist() == [0]
    crossed = x.clone()
    crossed[1, 1:] = x[0, 0]  # another batch's first row
    assert reference.differs(crossed).tolist() == [int(not torch.equal(x[0, 0], x[1, 0]))]


def test_a_proof_speaks_for_chunks_and_token_ranges_of_its_tensor() -> None:
    mod = _uniform(width=24)
    proof = UniformRows(mod, reference.differs(mod))
    shift, scale, gate = mod.chunk(3, dim=-1)
    assert proof.word(shift, scale) is proof.differs and proof.word(gate) is proof.differs
    assert proof.word(gate[:, 2:]) is proof.differs  # a pending stream's later tokens
    assert proof.word(mod) is proof.differs


def test_a_proof_does_not_speak_for_other_memory() -> None:
    mod = _uniform(width=24)
    proof = UniformRows(mod, reference.differs(mod))
    other = _uniform(width=24)
    assert proof.word(other.chunk(3, dim=-1)[0]) is None  # another tensor
    assert proof.word(mod.chunk(3, dim=-1)[0].contiguous()) is None  # a copy
    assert proof.word(mod[1:]) is None  # another batch count
    assert proof.word(mod.transpose(0, 1)) is None  # other strides
    assert proof.word(mod[:, :2].float()) is None  # another dtype
    assert proof.word(mod.chunk(3, dim=-1)[0], other) is None  # one view it does not cover
    assert proof.word("gate") is None  # type: ignore[arg-type]


def test_a_proof_of_a_slice_and_of_one_row_a_batch() -> None:
    """A source that starts inside a larger storage (its token range); a [B, 1, W] source, whose row
    stride may be anything (no word, and no error)."""
    storage = _uniform(batch=1, rows=9, width=24)
    source = storage[:, 3:]
    proof = UniformRows(source, reference.differs(source))
    assert proof.word(source.chunk(3, dim=-1)[1]) is proof.differs
    assert proof.word(storage[:, :3]) is None  # rows before the source's
    one_row = torch.randn(2, 24).to(torch.bfloat16).as_strided((2, 1, 24), (24, 0, 1))
    assert one_row.is_contiguous()
    assert UniformRows(one_row, reference.differs(one_row)).word(one_row) is None


def test_a_proof_stops_at_an_in_place_change_or_a_revocation() -> None:
    mod = _uniform(width=24)
    proof = UniformRows(mod, reference.differs(mod))
    gate = mod.chunk(3, dim=-1)[2]
    gate[:, -1] += 1  # the version counter moves for every view of it
    assert proof.word(gate) is None
    fresh = _uniform(width=24)
    revoked = UniformRows(fresh, reference.differs(fresh))
    revoked.revoke()
    assert revoked.word(fresh) is None


def test_inference_tensors_have_only_revocation() -> None:
    """Inference tensors keep no version counter: the proof holds until revoked (the block code
    revokes it where the tensor reaches code it does not own)."""
    with torch.inference_mode():
        mod = _uniform(width=24)
        proof = UniformRows(mod, reference.differs(mod))
        assert proof.version is None and proof.word(mod[..., :8]) is proof.differs
        proof.revoke()
        assert proof.word(mod[..., :8]) is None


BF16 = torch.bfloat16
CASES: dict[str, tuple[Any, str]] = {
    "x not a tensor": ([1.0], "x is not a tensor"),
    "x on the CPU": (torch.zeros(2, 5, 24, dtype=BF16), "x is on cpu, the kernel needs CUDA"),
    "dtype": (as_cuda(torch.zeros(2, 5, 24)), "dtype torch.float32 is not supported (bfloat16, float16)"),
    "4-D": (
        as_cuda(torch.zeros(1, 2, 5, 24, dtype=BF16)),
        r"x must be [B, S, W] or [S, W], got (1, 2, 5, 24)",
    ),
    "strided": (as_cuda(torch.zeros(2, 5, 48, dtype=BF16)[..., :24]), "x is not contiguous"),
    "narrow rows": (as_cuda(torch.zeros(2, 5, 4, dtype=BF16)), "a row of x is not a multiple of 16 bytes"),
    "misaligned": (as_cuda(misaligned(2, 5, 24)), "x data pointer is not 16-byte aligned"),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.usefixtures("accept_runtime")
def test_decline_reason(name: str) -> None:
    """Each reason, the validated op's error, and no proof from `check`."""
    x, expected = CASES[name]
    reason = uniform_rows.decline_reason(x)
    assert reason == expected
    assert uniform_rows.check(x) is None
    error = TypeError if isinstance(reason, TypeReason) else ValueError
    with pytest.raises(error, match=f"^{re.escape('flux2-fused: ' + expected)}$"):
        uniform_rows.uniform_rows(x)


def test_every_decline_reason_has_a_case() -> None:
    missing = untested(reason_templates(uniform_rows.guards), [reason for _, reason in CASES.values()])
    assert not missing, f"decline reasons without a test case: {missing}"


@pytest.mark.usefixtures("accept_runtime")
def test_a_model_never_checks_with_its_switch_off() -> None:
    assert uniform_rows.decline_reason(as_cuda(_uniform())) is None
    assert uniform_rows.check(as_cuda(_uniform()), enabled=False) is None
