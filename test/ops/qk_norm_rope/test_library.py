"""The torch.library operator: opcheck, eager equality (CPU and GPU) and gradients, in both modes."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.ops.qk_norm_rope import HEAD_DIM, Segment, library, reference

op = library.qk_norm_rope


def _inputs(device: str, dtype: torch.dtype, two: bool, with_v: bool, upcast: bool = False) -> tuple:
    """The operator's arguments: a double block's two segments (with v) or a single block's one;
    `upcast`: FLUX.3's mode, float32 weights."""
    gen = torch.Generator(device=device)
    gen.seed()

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    sizes = (5, 7) if two else (5,)
    q, k = [randn(2, n, 3, HEAD_DIM) for n in sizes], [randn(2, n, 3, HEAD_DIM) for n in sizes]
    v = [randn(2, n, 3, HEAD_DIM) for n in sizes] if with_v else []

    def weight() -> torch.Tensor:  # upcast: float32 of full precision
        w = torch.randn(HEAD_DIM, generator=gen, device=device)
        return w if upcast else w.to(dtype)

    q_weight, k_weight = [weight() for _ in sizes], [weight() for _ in sizes]
    cos = torch.rand(sum(sizes), HEAD_DIM, generator=gen, device=device)
    return q, q_weight, k, k_weight, v, cos, cos.flip(0).contiguous(), 1e-6, upcast


def _segments(xs: list[torch.Tensor], weights: list[torch.Tensor]) -> list[Segment]:
    return [Segment(x, w) for x, w in zip(xs, weights, strict=True)]


def _expected(args: tuple) -> list[torch.Tensor]:
    q, q_weight, k, k_weight, v, cos, sin, eps, upcast = args
    rows = (_segments(q, q_weight), _segments(k, k_weight))
    return [t for t in reference.prologue(*rows, cos, sin, eps, v or None, upcast=upcast) if t is not None]


def _check(device: str, dtype: torch.dtype) -> None:
    for two, with_v, upcast in (
        (False, False, False),
        (True, False, False),
        (True, True, False),
        (False, False, True),
        (True, True, True),
    ):
        args = _inputs(device, dtype, two, with_v, upcast)
        torch.library.opcheck(op, args)
        got, expected = op(*args), _expected(args)
        assert len(got) == len(expected) == (3 if with_v else 2)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_and_eager_equality_cpu(dtype):
    _check("cpu", dtype)


@pytest.mark.parametrize("upcast", [False, True])
def test_gradients_are_the_eager_chains_cpu(upcast):
    args = _inputs("cpu", torch.float32, True, True, upcast)
    leaves = [[x.detach().clone().requires_grad_() for x in args[i]] for i in (0, 2, 4)]
    clones = [[x.detach().clone().requires_grad_() for x in args[i]] for i in (0, 2, 4)]
    q, k, v = leaves
    sum(t.square().sum() for t in op(q, args[1], k, args[3], v, *args[5:])).backward()
    q, k, v = clones
    rows = (_segments(q, args[1]), _segments(k, args[3]))
    sum(t.square().sum() for t in reference.prologue(*rows, *args[5:8], v, upcast=upcast)).backward()
    for fused, eager in zip(leaves, clones, strict=True):
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(fused, eager, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_opcheck_and_eager_equality_gpu(dtype):
    _check("cuda", dtype)
