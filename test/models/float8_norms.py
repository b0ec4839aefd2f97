"""Shared by the families' float8 norm tests: a model's block Linears made torchao float8, and the
norms' quantizing forms (`gated_resnorm.quantized`, `sandwich_norm.quantized`) stood in for on the
CPU by torchao's per-row quantization of eager's out (modulation read as the kernel reads it with
the launch's uniform_rows words), which the GPU tests prove the kernels write."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from flux2_fused.ops import float8_quant, gated_resnorm, sandwich_norm

from ..conftest import as_kernel_reads
from ..test_float8_linear import to_float8


def float8_blocks(
    model: nn.Module, prefixes: tuple[str, ...], kind: str, keep: tuple[str, ...] = ()
) -> nn.Module:
    """`model` with the Linears under `prefixes` torchao float8 (`kind` scales) but those whose
    names end with one of `keep`."""
    for name, module in model.named_modules():
        if name.startswith(prefixes) and type(module) is nn.Linear and not name.endswith(keep):
            to_float8(module, kind)
    return model


def quantizing_norms(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The norms' quantizing form stood in for by torchao's per-row quantization of eager's out, and
    gated updates left pending as on a GPU (`gated_resnorm.defer` accepting them: the norms that
    consume them then run the eager chain, or the stand-in); returns the segments of each call."""
    calls: list[int] = []
    monkeypatch.setattr(gated_resnorm.guards, "defer", lambda *args: True)
    monkeypatch.setattr(gated_resnorm.guards, "defer2", lambda *args: True)

    def quantized(rows, scale, shift, eps, *, write_residual, mod_rows=None) -> tuple[Any, ...]:
        calls.append(len(rows))
        words = gated_resnorm._words(rows, scale, shift, mod_rows)
        out, stream = gated_resnorm.reference.segments(*as_kernel_reads(rows, scale, shift, words), eps)
        return (*float8_quant.reference.quantize(out, "row"), stream if write_residual else None)

    def sandwich(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
        calls.append(1)
        out, stream = sandwich_norm.reference.sandwich(*args, **kwargs)
        return (*float8_quant.reference.quantize(out, "row"), stream)

    monkeypatch.setattr(gated_resnorm, "quantized", quantized)
    monkeypatch.setattr(sandwich_norm, "quantized", sandwich)
    return calls


def hook_attention(block: nn.Module) -> None:
    """A no-op forward pre-hook on a block's attention, which makes the block code call the module."""
    attention = block.attention if hasattr(block, "attention") else block.attn  # Z-Image's name, FLUX's
    attention.register_forward_pre_hook(lambda module, args, kwargs: None, with_kwargs=True)
