"""CPU tests of the floor's record of a step's GEMM and attention calls (`bench.floor`); its CUDA
graph replay runs in the GPU scan test (test_step.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flux2_fused.bench.floor import ATTENTION_OPS, GEMM_OPS, floor_step, record, replay


class _Block(nn.Module):
    """Two projections, attention and an elementwise tail: what the floor keeps and what it drops."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        y = self.out(attn.transpose(1, 2).reshape(x.shape))
        return torch.nn.functional.gelu(y) * 2 + x


def test_record_keeps_gemms_and_attention_weights_by_reference_and_copies_activations() -> None:
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(2, 5, 16)
    with torch.inference_mode():
        calls = record(lambda: block(block(x)), block.parameters())
    funcs = [func for func, _, _ in calls]
    assert all(f in GEMM_OPS | ATTENTION_OPS for f in funcs)
    assert sum(f in ATTENTION_OPS for f in funcs) == 2 and sum(f in GEMM_OPS for f in funcs) == 4
    tensors = [a for _, args, _ in calls for a in args if isinstance(a, torch.Tensor)]
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    held = [t for t in tensors if t.untyped_storage().data_ptr() in weights]
    copies = [t for t in tensors if t.untyped_storage().data_ptr() not in weights]
    assert held and copies
    # The first projection's input is x itself, copied: same values and layout, a storage of its own.
    source = copies[0]
    assert torch.equal(source.reshape(-1), x.reshape(-1)) and source.data_ptr() != x.data_ptr()
    # One copy a layout: the second block's calls take the first one's buffers (same layouts).
    assert len({t.untyped_storage().data_ptr() for t in copies}) <= len(copies) // 2


def test_replay_runs_the_calls_and_the_floor_needs_some() -> None:
    block, x = _Block(), torch.randn(1, 3, 16)
    with torch.inference_mode():
        calls = record(lambda: block(x), block.parameters())
        replay(calls)  # the same operators on the held arguments: no error, nothing returned
        with pytest.raises(ValueError, match="no GEMM or attention call"):
            floor_step(lambda: F.gelu(x), block)


def test_outside_inference_mode_the_decomposed_products_are_noted_once() -> None:
    """Under no_grad a mode sees linear's addmm/mm (its weight as a transposed view, still the
    weight's storage: held, not copied) and never linear and addmm both."""
    block, x = _Block(), torch.randn(1, 3, 16)
    with torch.no_grad():
        calls = record(lambda: block(x), block.parameters())
    names = [str(func) for func, _, _ in calls]
    assert "aten.linear.default" not in names and len([n for n in names if "mm" in n]) == 2
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    held = [a for _, args, _ in calls for a in args if isinstance(a, torch.Tensor)]
    assert sum(t.untyped_storage().data_ptr() in weights for t in held) >= 2


def test_torchao_float8_linears_are_recorded_as_their_scaled_gemms() -> None:
    """The FP8 floor: a torchao float8 Linear (its weight as `quantize_` leaves it) reaches the recorder
    as `_scaled_mm` on its float8 data, the activation's quantization (elementwise) left out; the
    calls replay (torch's scaled GEMM runs on the CPU too)."""
    float8 = pytest.importorskip("torchao.quantization.quantize_.workflows.float8.float8_tensor")
    granularity = pytest.importorskip("torchao.quantization.granularity")
    torch.manual_seed(0)
    linear = nn.Linear(64, 32).to(torch.bfloat16)
    act = float8.QuantizeTensorToFloat8Kwargs(torch.float8_e4m3fn, granularity.PerRow())
    mm_config = pytest.importorskip("torchao.float8.inference").Float8MMConfig(use_fast_accum=True)
    weight = float8.Float8Tensor.from_hp(
        linear.weight.detach(), granularity=granularity.PerRow(), mm_config=mm_config, act_quant_kwargs=act
    )
    linear.weight = nn.Parameter(weight, requires_grad=False)
    x = torch.randn(2, 5, 64).to(torch.bfloat16)
    with torch.inference_mode():
        calls = record(lambda: linear(x), linear.parameters())
        assert [func for func, _, _ in calls] == [torch.ops.aten._scaled_mm.default]
        assert calls[0][1][0].dtype == torch.float8_e4m3fn
        replay(calls)
