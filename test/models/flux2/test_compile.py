"""torch.compile of the model: one graph (fullgraph), every fusable site a flux2_fused operator.

The graph is run by a recording backend that executes the traced aten graph as is, so the compiled
output must equal the eager model bit for bit: each custom op is the fused kernel or the eager chain
(on the CPU always the latter; on a GPU the kernel, which the GPU test counts), and nothing else
changes. Inductor itself is not bit-exact, which is why the compiled-tier speed is a benchmark
(`bench.step --compile`), not a test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from flux2_fused.models.flux2 import Flux2Transformer

from ...conftest import fused_launches, fused_sites
from ..test_deferral import make_inputs
from .test_model import TINY

# TINY's structure at a shape every op's kernel takes on a GPU: heads of 128 (the only head_dim the
# q/k prologue kernel reproduces; TINY's 16 always declines), two of them (D = 256, SwiGLU width 768).
COMPILED = dataclasses.replace(TINY, attention_head_dim=128, num_attention_heads=2, axes_dims_rope=(32,) * 4)


def _compile_and_compare(device: str, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """Compiles the model with the recording backend, checks its one graph's operators and that its
    output equals eager's; returns the compiled call, for a GPU test to count its launches."""
    model = Flux2Transformer.random(COMPILED, seed=2, device=device, dtype=dtype)
    inputs = {
        k: v.to(device) if isinstance(v, torch.Tensor) else v
        for k, v in make_inputs(COMPILED, 2, 33, 7).items()
    }
    inputs["hidden_states"] = inputs["hidden_states"].to(dtype)
    inputs["encoder_hidden_states"] = inputs["encoder_hidden_states"].to(dtype)
    graphs: list[torch.fx.GraphModule] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch.compiler.reset()
    compiled_model = torch.compile(model, fullgraph=True, backend=recording_backend)
    with torch.inference_mode():
        compiled = compiled_model(**inputs)
        eager = model(**inputs)
    assert len(graphs) == 1
    targets = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    gated = targets.count(torch.ops.flux2_fused.gated_resnorm.default)
    plain = targets.count(torch.ops.flux2_fused.modnorm.default)
    layers, single = COMPILED.num_layers, COMPILED.num_single_layers
    # Every norm but the two first ones and the one after the concat consumes a pending update.
    assert gated + plain == 4 * layers + single + 1
    assert plain == 3
    # q and k (and a double block's v) of every block: one attention-prologue operator.
    assert targets.count(torch.ops.flux2_fused.qk_norm_rope.default) == layers + single
    # SwiGLU: both feed-forwards of a double block, the MLP part of a single block.
    assert targets.count(torch.ops.flux2_fused.swiglu.default) == 2 * layers + single
    assert torch.equal(compiled, eager)
    return lambda: compiled_model(**inputs)


def test_fullgraph_compile_keeps_every_site_cpu():
    _compile_and_compare("cpu", torch.float32)


@pytest.mark.gpu
def test_fullgraph_compile_keeps_every_site_gpu():
    """On a GPU each operator of the compiled graph runs its kernel: as many launches in a compiled
    call as sites (the norm after the concat one launch, as in eager, on the concat the graph makes)."""
    call = _compile_and_compare("cuda", torch.bfloat16)
    with torch.inference_mode():
        launches = fused_launches(call)
    assert launches == fused_sites(COMPILED.num_layers, COMPILED.num_single_layers)


def test_compiled_training_step_matches_the_unfused_graph_cpu():
    """Compiled with gradients needed (parameters require grad, grad mode on), every operator is the
    differentiable eager chain: AOTAutograd traces through it, the loss equals eager's and the
    fast-path-off graph's bit for bit, and every parameter gets the same gradient up to summation
    order (the deferred output norm differentiates only the image rows, a different reduction)."""
    model = Flux2Transformer.random(TINY, seed=3, device="cpu", dtype=torch.float32)
    inputs = make_inputs(TINY, 2, 17, 5)
    losses, grads = {}, {}
    for fused in (True, False):
        model.fused = fused
        model.zero_grad(set_to_none=True)
        torch.compiler.reset()
        losses[fused] = torch.compile(model, fullgraph=True, backend="aot_eager")(**inputs).square().mean()
        losses[fused].backward()
        grads[fused] = [p.grad for p in model.parameters()]
    assert torch.equal(losses[True], model(**inputs).square().mean())
    assert torch.equal(losses[True], losses[False])
    for fused_grad, plain_grad in zip(grads[True], grads[False], strict=True):
        assert fused_grad is not None and fused_grad.abs().sum() > 0
        torch.testing.assert_close(fused_grad, plain_grad)


def test_qk_norms_without_eps_compile_to_the_eager_chain_cpu():
    """RMSNorms with eps=None (aten's own default) are no operator argument: the trace keeps the
    eager prologue for them, and the compiled model still equals the eager one."""
    model = Flux2Transformer.random(TINY, seed=4, device="cpu", dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, torch.nn.RMSNorm):
            module.eps = None
    inputs = make_inputs(TINY, 1, 9, 4)
    torch.compiler.reset()
    with torch.inference_mode():
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(**inputs)
        assert torch.equal(compiled, model(**inputs))
