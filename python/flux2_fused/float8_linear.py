"""torchao's float8 Linears, their activation quantized by `float8_quant`: torchao's bits, fewer kernels.

`quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow() | PerTensor()))`
leaves each Linear an `nn.Linear` whose weight is a torchao `Float8Tensor` carrying how to quantize
the input (`act_quant_kwargs`). On every call torchao quantizes the input with six eager kernels,
then runs its scaled GEMM. Here the input is quantized by the `float8_quant` op (one launch, the same
bytes and scales: docs/numerics.md, 15), once for every Linear that reads the same activation inside
`shared` (a block's q, k and v projections), and the GEMM is torchao's own `F.linear` on the
quantized input and the weight without its activation recipe: the same function, arguments and
kernel choice as torchao's call, so the output is torchao's bit for bit.

It applies only where torchao itself would take its torch quantization path: e4m3fn, PerRow over
the last dim or PerTensor, no value bounds, and a kernel preference that does not pick mslk's Triton
quantization (TORCH, or AUTO without mslk installed). A Linear whose call would run anything else
(hooks, an offload wrapper, a LoRA layer, another class) is the host's own call, and so is every call
under a torch.compile trace or the kill switch.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .ops import float8_quant, runtime

# torchao's float8 weights re-wrapped without their activation recipe, by the id of the weight they
# came from: (a weak reference to it, the fields the wrapper was made of, the wrapper).
_bare: dict[int, tuple[weakref.ref, tuple, Any]] = {}
# Inside `shared(x)`, per thread: (x, its quantizations by granularity).
_scope = threading.local()


def is_float8(weight: Any) -> bool:
    """Whether `weight` is a torchao `Float8Tensor` (by name: torchao need not be installed), a check
    cheap enough for every projection call."""
    cls = type(weight)
    return cls.__name__ == "Float8Tensor" and cls.__module__.startswith("torchao.")


def _recipe(weight: Any) -> tuple[str, Any] | None:
    """(granularity, torchao's activation kwargs) of a torchao float8 weight whose activation
    quantization takes torchao's torch path (the one `float8_quant` reproduces); None for any other
    weight."""
    if not is_float8(weight):
        return None
    from torchao.quantization.granularity import PerRow, PerTensor
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import KernelPreference
    from torchao.utils import _is_mslk_available

    kwargs = weight.act_quant_kwargs
    if kwargs is None or kwargs.float8_dtype != torch.float8_e4m3fn:
        return None
    if kwargs.hp_value_lb is not None or kwargs.hp_value_ub is not None:
        return None
    granularity = kwargs.granularity
    if type(granularity) is PerRow and granularity.dim in (-1, len(weight.shape) - 1):
        kind = "row"
    elif type(granularity) is PerTensor:
        kind = "tensor"
    else:
        return None
    preference = kwargs.kernel_preference
    if preference == KernelPreference.MSLK:
        return None
    if preference == KernelPreference.AUTO and kind == "row" and _is_mslk_available():
        return None  # torchao quantizes with mslk's Triton kernel there: other arithmetic
    return kind, kwargs


@contextmanager
def shared(x: torch.Tensor) -> Iterator[None]:
    """Within it (in this thread), the Linears that read x (which the caller does not change meanwhile:
    a block's q, k and v projections, Z-Image's two feed-forward inputs) quantize it once; nothing of
    x is kept after it."""
    outer = getattr(_scope, "current", None)
    _scope.current = (x, {})
    try:
        yield
    finally:
        _scope.current = outer


def _quantized(x: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized by the op, once per `shared` scope of x."""
    current = getattr(_scope, "current", None)
    if current is None or current[0] is not x:
        return float8_quant.apply(x, granularity)
    values = current[1]
    if granularity not in values:
        values[granularity] = float8_quant.apply(x, granularity)
    return values[granularity]


def _fields(weight: Any) -> tuple:
    """What the bare weight is made of: re-made when any of it changes (a new tensor, a new config)."""
    return (
        weight.qdata,
        weight.scale,
        tuple(weight.block_size),
        weight.mm_config,
        weight.kernel_preference,
        weight.dtype,
    )


def _bare_weight(weight: Any) -> Any:
    """The weight as torchao holds it, without its activation recipe: its GEMM then takes an input
    that is already quantized (torchao refuses one otherwise). Kept by the weight's id while the
    weight lives and its fields are the same objects and values."""
    fields = _fields(weight)
    entry = _bare.get(id(weight))
    if entry is not None and entry[0]() is weight and _same_fields(entry[1], fields):
        return entry[2]
    qdata, scale, block_size, mm_config, preference, dtype = fields
    bare = type(weight)(qdata, scale, list(block_size), mm_config, None, preference, dtype)
    key = id(weight)
    _bare[key] = (weakref.ref(weight, lambda _: _bare.pop(key, None)), fields, bare)
    return bare


def _same_fields(old: tuple, new: tuple) -> bool:
    """The tensors by identity (a value compare would read them), the rest by value."""
    return old[0] is new[0] and old[1] is new[1] and old[2:] == new[2:]


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """`module(x)` for a plain `nn.Linear` (the caller has checked nothing wraps it) holding a torchao
    float8 weight whose recipe `_recipe` accepts, with x quantized by the op; None where the module's
    own call must run."""
    recipe = _recipe(module.weight)
    if recipe is None or torch.compiler.is_compiling() or runtime.kill_switch():
        return None
    if not isinstance(x, torch.Tensor) or x.dtype != module.weight.dtype or x.requires_grad:
        return None
    granularity, kwargs = recipe
    from torchao.quantization.utils import get_block_size

    q, scale = _quantized(x, granularity)
    quantized = type(module.weight)(
        q,
        scale,
        list(get_block_size(x.shape, kwargs.granularity)),
        kwargs.mm_config,
        None,
        kwargs.kernel_preference,
        x.dtype,
    )
    return F.linear(quantized, _bare_weight(module.weight), module.bias)
