"""The torch.library operator: opcheck, eager equality (CPU and GPU) and gradients."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.ops.qk_norm_rope import HEAD_DIM, Segment, library, reference

op = library.qk_norm_rope


def _inputs(device: str, dtype: torch.dtype, two: bool) -> tuple:
    gen = torch.Generator(device=device)
    gen.seed()

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    x, x2 = randn(2, 5, 3, HEAD_DIM), randn(2, 7, 3, HEAD_DIM) if two else None
    w, w2 = randn(HEAD_DIM), randn(HEAD_DIM) if two else None
    tokens = 12 if two else 5
    cos = torch.rand(tokens, HEAD_DIM, generator=gen, device=device)
    return x, w, x2, w2, cos, cos.flip(0).contiguous(), 1e-6


def _check(device: str, dtype: torch.dtype) -> None:
    for two in (False, True):
        args = _inputs(device, dtype, two)
        torch.library.opcheck(op, args)
        rows = [Segment(args[0], args[1])] + ([Segment(args[2], args[3])] if two else [])
        assert torch.equal(op(*args), reference.qk_norm_rope(rows, *args[4:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_and_eager_equality_cpu(dtype):
    _check("cpu", dtype)


def test_gradients_are_the_eager_chains_cpu():
    args = list(_inputs("cpu", torch.float32, True))
    leaves = [a.requires_grad_() if isinstance(a, torch.Tensor) and a.dim() == 4 else a for a in args]
    op(*leaves).square().sum().backward()
    fused_grads = [leaves[0].grad, leaves[2].grad]
    clones = [
        a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.dim() == 4 else a
        for a in args
    ]
    rows = [Segment(clones[0], clones[1]), Segment(clones[2], clones[3])]
    reference.qk_norm_rope(rows, *clones[4:]).square().sum().backward()
    assert torch.equal(fused_grads[0], clones[0].grad) and torch.equal(fused_grads[1], clones[2].grad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_opcheck_and_eager_equality_gpu(dtype):
    _check("cuda", dtype)
