"""The eager reference is Z-Image's block arithmetic on diffusers' `RMSNorm` modules, op for op: checked
bit for bit on the CPU; and the mean's factor is aten's float32 quotient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flux2_fused.ops.sandwich_norm import reference
from flux2_fused.ops.sandwich_norm.launch import mean_factor

normalization = pytest.importorskip("diffusers.models.normalization")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_sites_are_z_images_block(dtype: torch.dtype) -> None:
    d = 256
    norms = [normalization.RMSNorm(d, eps=1e-5).to(dtype) for _ in range(2)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.normal_()
        x, attn_out = (torch.randn(2, 7, d) * 3).to(dtype), torch.randn(2, 7, d).to(dtype)
        gate, scale = torch.randn(2, 1, d).to(dtype).tanh(), 1.0 + torch.randn(2, 1, d).to(dtype)
        stream = x + gate * norms[0](attn_out)
        out, got = reference.sandwich(x, norms[1].weight, 1e-5, scale, attn_out, norms[0].weight, gate)
        assert torch.equal(got, stream)
        assert torch.equal(out, norms[1](stream) * scale)
        first, same = reference.sandwich(x, norms[1].weight, 1e-5)
        assert same is x and torch.equal(first, norms[1](x))
        none, ungated = reference.sandwich(x, None, 1e-5, update=attn_out, update_weight=norms[0].weight)
        assert none is None and torch.equal(ungated, x + norms[0](attn_out))


def test_mean_factor_is_atens_float32_quotient() -> None:
    assert mean_factor(4608, 3840) == float(np.float32(1.0) / np.float32(3840))
    # past 2**24 elements the count itself rounds to float32 before the division, as aten's does
    rows = 8191
    assert mean_factor(rows, 3968) == float(np.float32(rows) / np.float32(rows * 3968))
