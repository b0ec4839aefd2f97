"""The op as a torch.library operator, so torch.compile keeps the fused SwiGLU as one node.

`torch.ops.flux2_fused.swiglu(x, b=None) -> out` is `apply(x, b=b)`: the kernel where the guards
accept (decided when the op runs), the eager chain elsewhere. Where a gradient is needed it is the
differentiable eager chain. (The single block's write into half of a wider buffer stays an
eager-mode fusion: an operator that writes into its argument would have to be declared mutating,
and the compiled graph fuses the concatenation itself.) The pattern is every row-wise op's (`ops/rowwise.py`).
"""

from __future__ import annotations

from ..rowwise import define_operator
from . import apply, reference

_LIB, swiglu = define_operator("swiglu", apply, reference.swiglu, operands=2)
