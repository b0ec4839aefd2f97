"""Tests of the floor's record of a step's GEMM and attention calls and of its copied step
(`bench.floor`): on the CPU, and the copied step's CUDA graph on the GPU; the floor's replay runs in
the GPU scan test (test_step.py) too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flux2_fused.bench.floor import ATTENTION_OPS, GEMM_OPS, Copy, floor_step, record, replay
from flux2_fused.ops import jit


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


class _Kernels:
    """A stand-in for an op's kernel module (`jit.module_for`'s): `gelu` writes gelu(x) into out."""

    def gelu(self, out: torch.Tensor, x: torch.Tensor) -> None:
        out.copy_(F.gelu(x))


def test_the_copied_step_records_each_fused_launch_as_a_copy_of_its_bytes_in_its_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With `fused`, a launch through `jit.module_for` between the two projections is noted between
    their calls as the bytes it moves (its output and input); it still runs. Replayed, each copy moves
    half its bytes from the first scratch buffer into the second; without scratch it is refused."""
    monkeypatch.setattr(jit, "module_for", lambda spec, device: _Kernels())
    block, x = _Block(), torch.randn(2, 5, 16)

    def step() -> torch.Tensor:
        hidden = block.qkv(x)[..., :16]
        out = torch.empty_like(hidden)
        jit.module_for(None, x.device).gelu(out, hidden)
        return block.out(out)

    with torch.inference_mode():
        expected = block.out(F.gelu(block.qkv(x)[..., :16]))
        plain = record(step, block.parameters())
        assert [func for func, _, _ in plain] == [torch.ops.aten.linear.default] * 2
        calls = record(step, block.parameters(), fused=True)
        assert torch.equal(step(), expected)  # the launch ran while it was noted
        assert calls[1] == Copy(2 * 2 * 5 * 16 * 4) and [type(c) for c in calls] == [tuple, Copy, tuple]
        source, target = torch.arange(640, dtype=torch.uint8), torch.zeros(640, dtype=torch.uint8)
        replay(calls, (source, target))
        assert torch.equal(target, source)
        with pytest.raises(ValueError, match="scratch"):
            replay(calls)
    assert isinstance(jit.module_for(None, None), _Kernels)  # the counting put the module back


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


@pytest.mark.gpu
def test_the_copied_step_replays_a_real_launch_as_one_copy_on_the_gpu() -> None:
    """A projection, the SwiGLU kernel and a projection: the copied step's graph replays the two
    GEMMs and, between them, one device copy of the kernel's bytes, and nothing of the kernel."""
    from flux2_fused.bench.step import kernel_breakdown
    from flux2_fused.ops.swiglu import swiglu

    up = nn.Linear(256, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    down = nn.Linear(512, 256, bias=False, device="cuda", dtype=torch.bfloat16)
    model = nn.ModuleList([up, down])
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        calls = record(lambda: down(swiglu(up(x))), model.parameters(), fused=True)
        moved = 2 * 64 * (1024 + 512) * 2  # the projection read, the activation written
        assert [type(c) for c in calls] == [tuple, Copy, tuple] and calls[1] == Copy(moved)
        copied = floor_step(lambda: down(swiglu(up(x))), model, copies=True)
        copied()
        torch.cuda.synchronize()
        profile = kernel_breakdown(copied)
    assert profile.launches["gemm"] == 2 and profile.launches["fused"] == 0 and profile.launches["other"] == 1
