"""Which uniform_rows words a launch gets (CPU): each segment's gate's from the proof it was left
pending with, scale's and shift's from the site's proofs (one for every row, or one a segment); None
wherever no proof covers the tensors, and none at all for sites without proofs (FLUX.1's, FLUX.2's)."""

from __future__ import annotations

import torch

from flux2_fused.ops import gated_resnorm as op
from flux2_fused.ops.gated_resnorm import Segment
from flux2_fused.ops.uniform_rows import UniformRows, reference


def _proven(batch: int, tokens: int, dim: int) -> tuple[UniformRows, tuple[torch.Tensor, ...]]:
    mod = torch.randn(batch, 1, 3 * dim).to(torch.bfloat16).expand(batch, tokens, 3 * dim).contiguous()
    return UniformRows(mod, reference.differs(mod)), mod.chunk(3, dim=-1)


def _rows(batch: int, tokens: int, dim: int) -> torch.Tensor:
    return torch.randn(batch, tokens, dim).to(torch.bfloat16)


def test_sites_without_proofs_get_no_words() -> None:
    x = _rows(2, 5, 8)
    gate, scale, shift = torch.randn(3, 2, 1, 8).to(torch.bfloat16)
    assert op._words([Segment(x, x, gate)], scale, shift, None) is op.NO_WORDS


def test_a_mode_blocks_norm_gets_its_gates_and_its_modulations_words() -> None:
    proof, (shift, scale, gate) = _proven(2, 5, 8)
    x = _rows(2, 5, 8)
    pending = Segment(x, x, gate, "kernel", update2=x, gate_rows=proof)
    assert op._words([pending], scale, shift, proof) == (proof.differs, proof.differs, None, None)
    assert op._words([Segment(x)], scale, shift, proof) == (None, proof.differs, None, None)
    # A pending stream's later tokens keep the proof of its gate.
    assert op._words([pending.rows(2)], scale[:, 2:], shift[:, 2:], proof)[:2] == (proof.differs,) * 2


def test_twin_norms_get_a_word_a_segment() -> None:
    text_proof, (c_shift, c_scale, c_gate) = _proven(2, 3, 8)
    proof, (shift, scale, gate) = _proven(2, 5, 8)
    c, x = _rows(2, 3, 8), _rows(2, 5, 8)
    rows = [
        Segment(c, c, c_gate, update2=c, gate_rows=text_proof),
        Segment(x, x, gate, update2=x, gate_rows=proof),
    ]
    words = op._words(rows, (c_scale, scale), (c_shift, shift), (text_proof, proof))
    assert words == (text_proof.differs, text_proof.differs, proof.differs, proof.differs)
    # With a reference image the content rows have no proof: that segment's modulation reads per token.
    words = op._words(rows, (c_scale, scale), (c_shift, shift), (text_proof, None))
    assert words == (text_proof.differs, text_proof.differs, proof.differs, None)


def test_proofs_that_do_not_cover_the_tensors_give_no_word() -> None:
    proof, (shift, scale, _) = _proven(2, 5, 8)
    _, (other_shift, other_scale, other_gate) = _proven(2, 5, 8)
    x = _rows(2, 5, 8)
    stray = Segment(x, x, other_gate, update2=x, gate_rows=proof)
    assert op._words([stray], other_scale, other_shift, proof) == (None, None, None, None)
    assert op._words([stray], scale, other_shift, proof)[1] is None  # scale covered, shift not
    # A proof per segment where the modulation is one tensor for every row, or a count that is not
    # the segments': no words for the modulation.
    assert op._words([Segment(x)], scale, shift, (proof,))[1] is None
    assert op._words([Segment(x)], (scale,), (shift,), (proof, proof))[1] is None
