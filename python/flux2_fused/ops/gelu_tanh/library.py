"""The op as a torch.library operator, so torch.compile keeps the fused GELU as one node.

`torch.ops.flux2_fused.gelu_tanh(x) -> out` is `apply(x)`: the kernel where the guards accept
(decided when the op runs), eager's `F.gelu(x, approximate="tanh")` elsewhere. Where a gradient is
needed it is the differentiable eager op. (The single block's write into half of a wider buffer
stays an eager-mode fusion: an operator that writes into its argument would have to be declared
mutating, and the compiled graph fuses the concatenation itself.) The pattern is every row-wise
op's (`ops/rowwise.py`).
"""

from __future__ import annotations

from ..rowwise import define_operator
from . import apply, reference

_LIB, gelu_tanh = define_operator("gelu_tanh", apply, reference.gelu_tanh, operands=1)
