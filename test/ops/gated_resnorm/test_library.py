"""The torch.library operators: opcheck, eager equality, gradients, a compiled graph that keeps them,
and (on a GPU) the kernel launched through the dispatcher."""

from __future__ import annotations

import timeit

import pytest
import torch

from flux2_fused.ops.gated_resnorm import (
    Segment,
    apply,
    gated_resnorm_reference,
    library,  # noqa: F401  (registers torch.ops.flux2_fused)
    modnorm_reference,
)

from ...conftest import fused_launches


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


def _flux3_site(device: str, dtype: torch.dtype, batch: int = 2, tokens: int = 9, dim: int = 64):
    """(residual, update, update2, gate, scale, shift): FLUX.3's per-token chunk views of [B, T, 3D]."""
    gen = torch.Generator(device=device)
    gen.seed()

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    shift, scale, gate = randn(batch, tokens, 3 * dim).chunk(3, dim=-1)
    residual, update, update2 = (randn(batch, tokens, dim) for _ in range(3))
    return residual, update, update2, gate, scale, shift


def _check_flux3(device: str, dtype: torch.dtype) -> None:
    residual, update, update2, gate, scale, shift = _flux3_site(device, dtype)
    op = torch.ops.flux2_fused.gated_resnorm.default
    torch.library.opcheck(op, (residual, update, gate, scale, shift, 1e-6, update2))
    torch.library.opcheck(op, (residual, update, gate, scale, shift, 1e-6))  # one term, per-token rows
    torch.library.opcheck(torch.ops.flux2_fused.modnorm.default, (residual, scale[0], shift, 1e-6))
    out, res = torch.ops.flux2_fused.gated_resnorm(residual, update, gate, scale, shift, 1e-6, update2)
    ref_out, ref_res = gated_resnorm_reference(residual, update, gate, scale, shift, update2=update2)
    assert torch.equal(out, ref_out) and torch.equal(res, ref_res)
    assert torch.equal(res, residual + gate * (update + update2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_flux3_opcheck_and_eager_equality_cpu(dtype):
    _check_flux3("cpu", dtype)


def test_flux3_gradients_are_the_eager_chains_cpu():
    """With update2 and per-token rows the Autograd kernel is the differentiable eager chain too."""
    site = _flux3_site("cpu", torch.float32)
    leaves = [t.detach().clone().requires_grad_() for t in site]
    twins = [t.detach().clone().requires_grad_() for t in site]
    r, u, v, g, sc, sh = leaves
    out, res = torch.ops.flux2_fused.gated_resnorm(r, u, g, sc, sh, 1e-6, v)
    r2, u2, v2, g2, sc2, sh2 = twins
    ref_out, ref_res = gated_resnorm_reference(r2, u2, g2, sc2, sh2, update2=v2)
    assert torch.equal(out, ref_out) and torch.equal(res, ref_res)
    weights = [torch.randn_like(t) for t in (out, res)]
    sum((w * t).sum() for w, t in zip(weights, (out, res), strict=True)).backward()
    sum((w * t).sum() for w, t in zip(weights, (ref_out, ref_res), strict=True)).backward()
    for leaf, twin in zip(leaves, twins, strict=True):
        assert torch.equal(leaf.grad, twin.grad)


def test_fake_impls_give_eagers_shapes():
    """Under fake tensors the operators' outputs have the shapes eager's broadcasting gives: per-token
    rows, a second update, and a [T, D] stream that a [1, T, D] modulation makes [1, T, D]."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        r, u, v = (torch.empty(2, 9, 64, dtype=torch.bfloat16) for _ in range(3))
        shift, scale, gate = torch.empty(2, 9, 192, dtype=torch.bfloat16).chunk(3, dim=-1)
        out, res = torch.ops.flux2_fused.gated_resnorm(r, u, gate, scale, shift, 1e-6, v)
        assert out.shape == res.shape == (2, 9, 64)
        x = torch.empty(9, 64, dtype=torch.bfloat16)
        rows = torch.empty(1, 9, 64, dtype=torch.bfloat16)
        assert torch.ops.flux2_fused.modnorm(x, rows, rows, 1e-6).shape == (1, 9, 64)
        out, res = torch.ops.flux2_fused.gated_resnorm(x, x, x[0], rows, rows, 1e-6, x)
        assert out.shape == (1, 9, 64) and res.shape == (9, 64)


def test_compiled_flux3_sites_keep_the_ops_cpu():
    """FLUX.3's sites through the entry points under torch.compile(fullgraph=True): a two-term
    update deferred into a per-token norm is one gated operator; the single block's two segments
    with their own modulation are one operator each and a concat; the output norm the plain one.
    The graph's results equal the eager chains."""
    from flux2_fused.ops import gated_resnorm

    text, image, dim = 7, 37, 64
    r_t, u_t, v_t, g_t, sc_t, sh_t = _flux3_site("cpu", torch.float32, tokens=text, dim=dim)
    r_i, u_i, v_i, g_i, sc_i, sh_i = _flux3_site("cpu", torch.float32, tokens=image, dim=dim)

    def sites(r_t, u_t, v_t, g_t, sc_t, sh_t, r_i, u_i, v_i, g_i, sc_i, sh_i):
        mode = gated_resnorm.defer(r_i, u_i, g_i, update2=v_i)
        mode_out, mode_stream = apply([mode], sc_i, sh_i, 1e-6, write_residual=True)
        rows = [
            gated_resnorm.defer(r_t, u_t, g_t, update2=v_t),
            gated_resnorm.defer(r_i, u_i, g_i, update2=v_i),
        ]
        joint_out, joint_stream = apply(rows, (sc_t, sc_i), (sh_t, sh_i), 1e-6, write_residual=True)
        final = apply([Segment(joint_stream[:, text:])], sc_i, sh_i, 1e-6, write_residual=False)[0]
        return mode_out, mode_stream, joint_out, joint_stream, final

    args = (r_t, u_t, v_t, g_t, sc_t, sh_t, r_i, u_i, v_i, g_i, sc_i, sh_i)
    graphs: list[torch.fx.GraphModule] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch.compiler.reset()
    compiled = torch.compile(sites, fullgraph=True, backend=recording_backend)(*args)
    assert len(graphs) == 1
    targets = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.flux2_fused.gated_resnorm.default) == 3
    assert targets.count(torch.ops.flux2_fused.modnorm.default) == 1
    mode_ref = gated_resnorm_reference(r_i, u_i, g_i, sc_i, sh_i, update2=v_i)
    rows = [Segment(r_t, u_t, g_t, update2=v_t), Segment(r_i, u_i, g_i, update2=v_i)]
    joint_ref = gated_resnorm.reference.segments(rows, (sc_t, sc_i), (sh_t, sh_i))
    final_ref = modnorm_reference(joint_ref[1][:, text:], sc_i, sh_i)
    for got, want in zip(compiled, (*mode_ref, *joint_ref, final_ref), strict=True):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_opcheck_and_eager_equality_gpu(dtype):
    _check("cuda", dtype)


@pytest.mark.gpu
def test_operator_runs_the_kernel_and_its_dispatch_cost_is_reported_gpu():
    """On CUDA tensors the operator runs the fused kernel, one launch a call, as `apply` (the entry
    point eager mode calls directly) does, both with the eager chain's bits. The operator's host cost
    over `apply` (why eager mode skips the dispatcher) is printed, not asserted: a bound on host
    time would fail on a busy machine, not on a regression."""
    site = _site("cuda", torch.bfloat16, batch=1, tokens=1, dim=3072)
    residual, update, gate, scale, shift = site
    calls = {
        "operator": lambda: torch.ops.flux2_fused.gated_resnorm(*site, 1e-6),
        "apply": lambda: apply([Segment(residual, update, gate)], scale, shift, 1e-6, write_residual=True),
    }
    expected = gated_resnorm_reference(*site)
    host_us = {}
    for name, call in calls.items():
        out, res = call()  # the first call builds and self-checks the kernel
        assert torch.equal(out, expected[0]) and torch.equal(res, expected[1]), name
        assert fused_launches(lambda call=call: [call() for _ in range(10)]) == 10, name
        torch.cuda.synchronize()
        host_us[name] = 1e6 * timeit.timeit(call, number=200) / 200
        torch.cuda.synchronize()
    print(
        f"operator dispatch: {host_us['operator'] - host_us['apply']:.1f} us a call over apply's "
        f"{host_us['apply']:.1f} us"
    )


@pytest.mark.gpu
def test_compiled_chain_is_bit_exact_gpu():
    """Inside an Inductor graph the op still equals the eager chain (Inductor's own fusion does not)."""
    residual, update, gate, scale, shift = _site("cuda", torch.bfloat16, batch=1, tokens=4608, dim=3072)

    def chain(r, u, g, sc, sh):
        return torch.ops.flux2_fused.gated_resnorm(r, u, g, sc, sh, 1e-6)

    out, res = torch.compile(chain, fullgraph=True)(residual, update, gate, scale, shift)
    ref_out, ref_res = gated_resnorm_reference(residual, update, gate, scale, shift)
    assert torch.equal(out, ref_out) and torch.equal(res, ref_res)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_flux3_opcheck_and_eager_equality_gpu(dtype):
    _check_flux3("cuda", dtype)


@pytest.mark.gpu
def test_compiled_flux3_chain_is_bit_exact_gpu():
    """Inside an Inductor graph the two-term, per-token op still equals the eager chain."""
    residual, update, update2, gate, scale, shift = _flux3_site("cuda", torch.bfloat16, 1, 4096 + 7, 3072)

    def chain(r, u, v, g, sc, sh):
        return torch.ops.flux2_fused.gated_resnorm(r, u, g, sc, sh, 1e-6, v)

    out, res = torch.compile(chain, fullgraph=True)(residual, update, update2, gate, scale, shift)
    ref_out, ref_res = gated_resnorm_reference(residual, update, gate, scale, shift, update2=update2)
    assert torch.equal(out, ref_out) and torch.equal(res, ref_res)
