"""`ops.FUSED_KERNELS`: each op's kernel name is the `__global__` function its sources define.

The benchmarks and the launch-counting tests find the ops' launches in a profile by these names; a
kernel renamed in its .cuh without its `KERNEL` would leave them counting none, silently (zero fused
launches reads as "nothing fused", not as an error).
"""

from __future__ import annotations

import re

import pytest

from flux2_fused.ops import FUSED_KERNELS, OPS, FusedOp, jit


@pytest.mark.parametrize(
    ("op", "kernel"), list(zip(OPS, FUSED_KERNELS, strict=True)), ids=[op.name for op in OPS]
)
def test_each_kernel_name_is_a_global_function_of_its_ops_sources(op: FusedOp, kernel: str) -> None:
    sources = "\n".join((jit.CSRC / name).read_text() for name in (*op.spec.sources, *op.spec.headers))
    defined = re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(", sources)
    assert kernel in defined, defined
