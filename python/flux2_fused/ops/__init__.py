"""Fused CUDA ops, one package each, every one bit-exact to the eager chain it replaces.

Each op package (`gated_resnorm/`, `gelu_tanh/`, `qk_norm_rope/`, `swiglu/`, `sandwich_norm/`,
`float8_quant/`, and `uniform_rows/`, which replaces no chain: it proves on the GPU that
modulation rows are equal, so `gated_resnorm` may read one for all) holds its eager reference (the
contract), its guards, its launcher and kernel spec, its self-check and (all but `sandwich_norm`,
`float8_quant` and `uniform_rows`, whose sites run eagerly under a trace) its torch.library
operators, and exports one entry point that guards and launches, falling back to the reference.
What every op shares lives beside them: `jit` (building and loading kernels), `runtime` (kill
switch, self-check verdicts), `verdicts` (guard machinery), `bits` (bit-level comparison) and
`rowwise` (what the row-wise elementwise ops, `gelu_tanh` and `swiglu`, share).
docs/architecture.md says how a new op plugs in.
"""

from . import float8_quant, gated_resnorm, gelu_tanh, qk_norm_rope, sandwich_norm, swiglu, uniform_rows
from .bits import bits_equal, every_bit_pattern, random_bits
from .runtime import (
    DISABLE_ENV,
    FusedOp,
    fast_path_reason,
    kill_switch,
    module_sources,
    self_check_records,
)

# Every op with a kernel, each package exporting its FusedOp (`OP`) and its kernel's name (`KERNEL`).
_PACKAGES = (gated_resnorm, qk_norm_rope, swiglu, gelu_tanh, sandwich_norm, float8_quant, uniform_rows)
# `flux2-fused build` compiles their specs, `flux2-fused verify` runs their self-checks.
OPS: tuple[FusedOp, ...] = tuple(package.OP for package in _PACKAGES)
# Their kernels, by the name profilers show inside each launch's templated signature: how the
# benchmarks and tests tell this package's launches from aten's, whatever the instantiation, and
# which op a launch belongs to (`KERNEL_OPS`: kernel name -> op name).
KERNEL_OPS: dict[str, str] = {package.KERNEL: package.OP.name for package in _PACKAGES}
FUSED_KERNELS: tuple[str, ...] = tuple(KERNEL_OPS)

__all__ = [
    "DISABLE_ENV",
    "FUSED_KERNELS",
    "KERNEL_OPS",
    "OPS",
    "FusedOp",
    "bits_equal",
    "every_bit_pattern",
    "fast_path_reason",
    "float8_quant",
    "gated_resnorm",
    "gelu_tanh",
    "kill_switch",
    "module_sources",
    "qk_norm_rope",
    "random_bits",
    "sandwich_norm",
    "self_check_records",
    "swiglu",
    "uniform_rows",
]
