"""CPU tests of counting the bytes a step's fused kernels move (`bench.traffic`), with a stand-in for a
kernel module; the GPU scan test (test_step.py) counts a real step's."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.bench.traffic import bytes_by_op, launch_bytes
from flux2_fused.ops import jit


class _Kernels:
    """A stand-in for an op's kernel module (`jit.module_for`'s): `double` writes x * 2 into out."""

    def double(self, out: torch.Tensor, x: torch.Tensor, eps: float) -> None:
        out.copy_(x * 2)


def test_a_launch_moves_its_tensors_elements_once() -> None:
    """Views count their elements, not their storage; what is not a tensor (eps, None) moves nothing."""
    base = torch.empty(3, 32)
    assert launch_bytes([torch.empty(3, 16), base[:, ::2], 1e-6, None]) == 2 * 3 * 16 * 4
    bf16, fp8 = torch.empty(5, dtype=torch.bfloat16), torch.empty(5, dtype=torch.float8_e4m3fn)
    assert launch_bytes([bf16, fp8]) == 15


def test_a_steps_launches_are_counted_while_they_run_and_the_module_is_put_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(jit, "module_for", lambda spec, device: _Kernels())
    x = torch.randn(4, 8)
    out = torch.empty(4, 8)

    def step() -> torch.Tensor:
        for _ in range(3):
            jit.module_for(None, x.device).double(out, x, 1e-6)
        return out

    assert bytes_by_op(step) == {"": 3 * 2 * 4 * 8 * 4}  # the stand-in's spec (None) has no name
    assert torch.equal(out, x * 2)  # the launches ran
    assert isinstance(jit.module_for(None, None), _Kernels)  # what was there before
    assert bytes_by_op(lambda: None) == {}


def test_a_failing_step_puts_the_module_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jit, "module_for", lambda spec, device: _Kernels())

    def step() -> None:
        raise RuntimeError("the step failed")

    with pytest.raises(RuntimeError, match="the step failed"):
        bytes_by_op(step)
    assert isinstance(jit.module_for(None, None), _Kernels)


def test_gated_resnorm_counts_proven_modulation_rows_once_a_batch() -> None:
    """Its launch's arguments as `gated_resnorm.launch` passes them: with a word of 0 the gate and the
    scale and shift move one row a batch; with a word of 1, or none, every token's row."""
    from flux2_fused.ops.gated_resnorm.launch import moved_bytes

    batch, tokens, dim = 2, 5, 8
    stream = torch.empty(batch, tokens, dim, dtype=torch.bfloat16)
    shift, scale, gate = torch.empty(batch, tokens, 3 * dim, dtype=torch.bfloat16).chunk(3, dim=-1)
    equal, differs = torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)

    def args(words: tuple) -> tuple:
        segment = (stream, stream, stream, gate, None, None, None, None)
        return (stream, None, stream, scale, shift, None, None, *segment, 1e-6, False, *words)

    row, rows = batch * dim * 2, batch * tokens * dim * 2
    every = 5 * rows + 3 * rows  # out, residual_out, residual, update, update2; gate, scale, shift
    assert moved_bytes(args((None, None, None, None))) == every
    assert moved_bytes(args((differs, differs, None, None))) == every
    assert moved_bytes(args((equal, equal, None, None))) == 5 * rows + 3 * row
    assert moved_bytes(args((None, equal, None, None))) == 5 * rows + rows + 2 * row


def test_float8_quant_counts_x_twice_where_it_reduces_the_tensors_amax() -> None:
    """Per row, and per tensor with the amax words another kernel left: each tensor once; per tensor
    reduced here: x read by both kernels."""
    from flux2_fused.ops.float8_quant.launch import moved_bytes

    x = torch.empty(3, 64, dtype=torch.bfloat16)
    q = torch.empty(3, 64, dtype=torch.uint8)
    row_scale, tensor_scale = torch.empty(3, 1), torch.empty(1, 1)
    words = torch.empty(1024, dtype=torch.int32)
    assert moved_bytes((q, row_scale, x, None, 0)) == 192 + 12 + 384
    assert moved_bytes((q, tensor_scale, x, words, 3)) == 192 + 4 + 384 + 4096
    assert moved_bytes((q, tensor_scale, x, words, 0)) == 192 + 4 + 2 * 384 + 4096
