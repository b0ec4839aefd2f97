"""GPU tests: the uniform-rows kernel's word is its predicate's, on FLUX.3's modulation shapes and on
the differences a naive comparison misses; its self-check passes; a proof made on the GPU is read by
gated_resnorm (`test/ops/gated_resnorm/test_kernel_gpu.py` checks its kernel with the words)."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.ops import self_check_records, uniform_rows
from flux2_fused.ops.uniform_rows import reference
from flux2_fused.ops.uniform_rows.launch import launch

from ...conftest import fused_launches

pytestmark = pytest.mark.gpu


def _uniform(batch: int, rows: int, width: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    first = torch.randn(batch, 1, width, generator=gen, device="cuda").to(dtype)
    return first.expand(batch, rows, width).contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("batch", "rows"), [(1, 4096), (2, 4096), (1, 512), (2, 7), (3, 1), (1, 4608)])
def test_the_word_is_the_predicates(batch: int, rows: int, dtype: torch.dtype, gen: torch.Generator) -> None:
    width = 3 * 3072  # FLUX.3 [klein]'s [B, S, 3D] modulation
    x = _uniform(batch, rows, width, dtype, gen)
    assert uniform_rows.uniform_rows(x).tolist() == [0]
    for b, r, c in ((batch - 1, rows - 1, width - 1), (0, rows // 2, 0), (batch - 1, rows - 1, 0)):
        y = x.clone()
        y.view(torch.int16)[b, r, c] ^= -(1 << 15)  # the sign bit: -0.0 against +0.0 where it was 0
        assert uniform_rows.uniform_rows(y).tolist() == reference.differs(y).tolist() == [int(rows > 1)]
    chunk = x.chunk(3, dim=-1)[1]  # a strided view (the kernel takes it; proofs are of whole tensors)
    y = x.clone()
    y[:, -1, : width // 3] += 1
    assert launch(y.chunk(3, dim=-1)[1]).tolist() == [0] and launch(chunk).tolist() == [0]
    assert launch(y).tolist() == [int(rows > 1)]


def test_check_makes_a_proof_in_one_launch_and_its_self_check_passes(gen: torch.Generator) -> None:
    x = _uniform(2, 512, 9216, torch.bfloat16, gen)
    assert uniform_rows.decline_reason(x) is None
    proof = uniform_rows.check(x)
    assert proof is not None and proof.differs.tolist() == [0]
    assert fused_launches(lambda: uniform_rows.check(x)) == 1
    records = self_check_records()
    assert all(r.passed for key, r in records.items() if key[0] == "uniform_rows"), records
    for dtype in (torch.bfloat16, torch.float16):
        passed, detail = uniform_rows.self_check(torch.device("cuda"), uniform_rows.Config(dtype))
        assert passed, detail
