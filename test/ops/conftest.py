"""Helpers shared by the CPU tests of every op.

The guards read only tensor metadata, so CPU-only CI can reach every check: `as_cuda` wraps a CPU
or meta tensor in a stand-in that reports a CUDA device, while shape, strides, storage offset,
dtype, data pointer and requires_grad stay the wrapped tensor's own. No kernel ever runs on one;
the steps that would need a GPU (kill switch aside: the self-check) are replaced by `accept_runtime`.
"""

from __future__ import annotations

import math

import pytest
import torch

from flux2_fused.ops import runtime


class _CudaStandIn(torch.Tensor):
    """A tensor that says it lives on cuda:<index>; see `as_cuda`."""

    # Plain torch semantics for every op (results are ordinary tensors), only `device` differs.
    __torch_function__ = torch._C._disabled_torch_function_impl
    cuda_index: int

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self.cuda_index)


def as_cuda(t: torch.Tensor, index: int = 0) -> torch.Tensor:
    """`t` (same storage, view and grad flag) reporting device cuda:`index` to the guards."""
    out = torch.Tensor._make_subclass(_CudaStandIn, t, t.requires_grad)
    out.cuda_index = index
    return out


def misaligned(*shape: int, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> torch.Tensor:
    """A contiguous tensor whose data pointer sits one element past an aligned allocation."""
    return torch.zeros(math.prod(shape) + 1, dtype=dtype, device=device)[1:].view(shape)


@pytest.fixture
def accept_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accept whatever passes the metadata checks: stands in for the kill switch and the self-check."""
    monkeypatch.setattr(runtime, "runtime_reason", lambda op, device, config: None)
