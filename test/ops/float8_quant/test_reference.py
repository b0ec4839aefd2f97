"""The float8 quantization reference is torchao's own arithmetic: `Float8Tensor.from_hp` (its torch
path, as `Float8DynamicActivationFloat8WeightConfig` quantizes an activation) gives the same bytes and
scales, per row and per tensor, on random rows and the edge rows the self-check feeds (zero, tiny,
subnormal, at and past 448, NaN, +-Inf, constant), in bf16 and fp16, [B, S, K] and [M, K]."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.ops.float8_quant import reference
from flux2_fused.ops.float8_quant.selfcheck import edge_rows, same

float8 = pytest.importorskip("torchao.quantization.quantize_.workflows.float8.float8_tensor")
granularities = pytest.importorskip("torchao.quantization.granularity")


def _torchao(x: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    kind = granularities.PerRow() if granularity == "row" else granularities.PerTensor()
    t = float8.Float8Tensor.from_hp(
        x, float8_dtype=torch.float8_e4m3fn, granularity=kind, kernel_preference=float8.KernelPreference.TORCH
    )
    return t.qdata, t.scale


@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reference_is_torchaos_quantization(dtype: torch.dtype, granularity: str) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 19, 520, generator=gen) * 3).to(dtype)
    rows = [x.clone(), x[0].clone()]
    edge_rows(rows[0])
    for t in rows:
        assert same(reference.quantize(t, granularity), _torchao(t, granularity))


def test_an_all_zero_row_is_nan_and_the_tensor_scale_sees_every_row() -> None:
    x = torch.randn(3, 16).to(torch.bfloat16)
    x[1] = 0.0
    q, s = reference.quantize(x, "row")
    assert q[1].float().isnan().all() and s[1].item() == 0.0 and not q[0].float().isnan().any()
    q, s = reference.quantize(x, "tensor")
    assert s.shape == (1, 1) and s.item() == (x.abs().max() / 448.0).float().item()
