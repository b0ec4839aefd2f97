"""The torch.library operators: opcheck, eager equality, gradients, and a compiled graph that keeps them."""

from __future__ import annotations

import timeit

import pytest
import torch

from flux2_fused.ops.gated_resnorm import (
    gated_resnorm_reference,
    library,  # noqa: F401  (registers torch.ops.flux2_fused)
    modnorm_reference,
)


def _site(device: str, dtype: torch.dtype, batch: int = 2, tokens: int = 9, dim: int = 64):
    gen = torch.Generator(device=device)
    gen.seed()
    mod = torch.randn(batch, 1, 6 * dim, generator=gen, device=device).to(dtype)
    shift, scale, gate = mod.chunk(6, dim=-1)[:3]
    residual = torch.randn(batch, tokens, dim, generator=gen, device=device).to(dtype)
    update = torch.randn(batch, tokens, dim, generator=gen, device=device).to(dtype)
    return residual, update, gate, scale, shift


def _check(device: str, dtype: torch.dtype) -> None:
    residual, update, gate, scale, shift = _site(device, dtype)
    torch.library.opcheck(
        torch.ops.flux2_fused.gated_resnorm.default, (residual, update, gate, scale, shift, 1e-6)
    )
    torch.library.opcheck(torch.ops.flux2_fused.modnorm.default, (residual, scale, shift, 1e-6))
    out, res = torch.ops.flux2_fused.gated_resnorm(residual, update, gate, scale, shift, 1e-6)
    ref_out, ref_res = gated_resnorm_reference(residual, update, gate, scale, shift)
    assert torch.equal(out, ref_out) and torch.equal(res, ref_res)
    assert torch.equal(
        torch.ops.flux2_fused.modnorm(residual, scale, shift, 1e-6), modnorm_reference(residual, scale, shift)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_and_eager_equality_cpu(dtype):
    _check("cpu", dtype)


@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad", "no_grad"])
def test_gradients_are_the_eager_chains_cpu(grad_mode):
    """With a gradient needed the op is the differentiable eager chain (same values, same gradients);
    under no_grad the same inputs give the same values and no graph."""
    site = _site("cpu", torch.float32)
    leaves = [t.clone().requires_grad_() for t in site]
    ref_leaves = [t.clone().requires_grad_() for t in site]
    with torch.set_grad_enabled(grad_mode):
        out, res = torch.ops.flux2_fused.gated_resnorm(*leaves, 1e-6)
        ref_out, ref_res = gated_resnorm_reference(*ref_leaves)
        norm = torch.ops.flux2_fused.modnorm(leaves[0], leaves[3], leaves[4], 1e-6)
        ref_norm = modnorm_reference(ref_leaves[0], ref_leaves[3], ref_leaves[4])
    assert torch.equal(out, ref_out) and torch.equal(res, ref_res) and torch.equal(norm, ref_norm)
    assert out.requires_grad == grad_mode and norm.requires_grad == grad_mode
    if grad_mode:
        weights = [torch.randn_like(t) for t in (out, res, norm)]
        loss = sum((w * t).sum() for w, t in zip(weights, (out, res, norm), strict=True))
        ref_loss = sum((w * t).sum() for w, t in zip(weights, (ref_out, ref_res, ref_norm), strict=True))
        loss.backward()
        ref_loss.backward()
        for leaf, ref_leaf in zip(leaves, ref_leaves, strict=True):
            assert torch.equal(leaf.grad, ref_leaf.grad)
        torch.library.opcheck(torch.ops.flux2_fused.gated_resnorm.default, (*leaves, 1e-6))


def test_compiled_graph_keeps_the_op_cpu():
    residual, update, gate, scale, shift = _site("cpu", torch.bfloat16)

    def chain(r, u, g, sc, sh):
        out, res = torch.ops.flux2_fused.gated_resnorm(r, u, g, sc, sh, 1e-6)
        return out * 2, res

    compiled = torch.compile(chain, fullgraph=True, backend="aot_eager")
    out, res = compiled(residual, update, gate, scale, shift)
    ref_out, ref_res = gated_resnorm_reference(residual, update, gate, scale, shift)
    assert torch.equal(out, ref_out * 2) and torch.equal(res, ref_res)


def test_custom_op_dispatch_overhead_is_reported():
    """Host cost of the operator dispatch over a direct call (why eager mode skips it); no assertion
    on speed, only that both paths give the same bits."""
    site = _site("cpu", torch.float32, batch=1, tokens=1, dim=8)
    direct = timeit.timeit(lambda: gated_resnorm_reference(*site), number=200) / 200
    op = timeit.timeit(lambda: torch.ops.flux2_fused.gated_resnorm(*site, 1e-6), number=200) / 200
    print(
        f"operator dispatch: {1e6 * (op - direct):.1f} us a call over the direct one ({1e6 * direct:.1f} us)"
    )
    assert torch.equal(torch.ops.flux2_fused.gated_resnorm(*site, 1e-6)[0], gated_resnorm_reference(*site)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_opcheck_and_eager_equality_gpu(dtype):
    _check("cuda", dtype)


@pytest.mark.gpu
def test_compiled_chain_is_bit_exact_gpu():
    """Inside an Inductor graph the op still equals the eager chain (Inductor's own fusion does not)."""
    residual, update, gate, scale, shift = _site("cuda", torch.bfloat16, batch=1, tokens=4608, dim=3072)

    def chain(r, u, g, sc, sh):
        return torch.ops.flux2_fused.gated_resnorm(r, u, g, sc, sh, 1e-6)

    out, res = torch.compile(chain, fullgraph=True)(residual, update, gate, scale, shift)
    ref_out, ref_res = gated_resnorm_reference(residual, update, gate, scale, shift)
    assert torch.equal(out, ref_out) and torch.equal(res, ref_res)
