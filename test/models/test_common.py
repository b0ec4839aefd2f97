"""CPU tests of the block code's shared pieces: `project_activation` hands a float8 Linear the
activation's quantization from the op's kernel where the host takes it, and its values elsewhere."""

from __future__ import annotations

import pytest
import torch

from flux2_fused import float8_linear
from flux2_fused.host import ModuleHost
from flux2_fused.models.common import project_activation
from flux2_fused.models.deferral import Fusion
from flux2_fused.ops import float8_quant, gelu_tanh, swiglu

from ..test_float8_linear import _linear, _x

pytest.importorskip("torchao.quantization.quantize_.workflows.float8.float8_tensor")
HOST = ModuleHost(frozenset())


def _kernel_standin(op, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The op's quantizing kernel stood in for by torchao's quantization of eager's joint row (what
    the GPU tests prove the kernel writes); returns the calls it took."""
    calls: list[str] = []

    def quantized(x, *, prefix=None, b=None, granularity="row"):
        calls.append(f"quantized per {granularity}")
        value = op.reference.swiglu(x, b) if op is swiglu and b is not None else op.apply(x, enabled=False)
        joint = value if prefix is None else torch.cat([prefix, value], dim=-1)
        return float8_quant.reference.quantize(joint, granularity)

    monkeypatch.setattr(op, "quantized", quantized)
    return calls


@pytest.mark.parametrize(
    ("op", "shape", "prefix", "pair"),
    [
        (swiglu, (2, 5, 128), None, False),
        (swiglu, (2, 5, 96), 16, False),
        (swiglu, (2, 5, 64), None, True),
        (gelu_tanh, (2, 5, 48), 16, False),
    ],
    ids=["feed-forward", "single block", "two projections", "gelu single block"],
)
def test_a_float8_linear_gets_the_kernels_quantization(op, shape, prefix, pair, monkeypatch) -> None:
    """Per row and per tensor: the op's quantizing form runs, the activation is never computed, and
    the output is torchao's call on eager's joint row. With fusion off: the activation, then the
    call."""
    calls = _kernel_standin(op, monkeypatch)
    x = _x(*shape)
    b = _x(*shape) * 0.5 if pair else None
    head = _x(shape[0], shape[1], prefix) if prefix else None
    value = op.reference.swiglu(x, b) if pair else op.apply(x, enabled=False)
    joint = value if head is None else torch.cat([head, value], dim=-1)
    for kind, fusion, runs in (
        ("row", Fusion(), 1),
        ("tensor", Fusion(), 1),
        ("row", Fusion(fused=False), 0),
    ):
        module = _linear(kind)
        calls.clear()
        with torch.inference_mode():
            got = project_activation(HOST, module, op, fusion, x, prefix=head, b=b)
            assert torch.equal(got, module(joint))
        assert calls == [f"quantized per {kind}"] * runs


def test_a_declining_kernel_or_a_plain_linear_gets_the_activation(monkeypatch: pytest.MonkeyPatch) -> None:
    x, head = _x(2, 5, 96), _x(2, 5, 16)
    joint = torch.cat([head, swiglu.apply(x, enabled=False)], dim=-1)
    with torch.inference_mode():
        for kind in ("row", "tensor"):
            module = _linear(kind)
            assert swiglu.quantized(x, prefix=head, granularity=kind) is None  # the CPU: the guards decline
            assert torch.equal(
                project_activation(HOST, module, swiglu, Fusion(), x, prefix=head), module(joint)
            )
        plain = torch.nn.Linear(64, 48).to(torch.bfloat16)
        assert torch.equal(project_activation(HOST, plain, swiglu, Fusion(), x, prefix=head), plain(joint))
    assert float8_linear.granularity(plain) is None
