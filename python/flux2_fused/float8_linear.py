"""torchao's float8 Linears, their activation quantized by `float8_quant`: torchao's bits, fewer kernels.

`quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow() | PerTensor()))`
leaves each Linear an `nn.Linear` whose weight is a torchao `Float8Tensor` carrying how to quantize
the input (`act_quant_kwargs`). On every call torchao quantizes the input with six eager kernels,
then runs its scaled GEMM. Here the input is quantized by the `float8_quant` op (one launch, the same
bytes and scales: docs/numerics.md, 15), once for every Linear that reads the same activation inside
`shared` (a block's q, k and v projections), and the GEMM is torchao's own: the same `_scaled_mm`
call with the same arguments as torchao's, so the output is torchao's bit for bit.

With torchao 0.18 (whose code this module was read against) the GEMM is the torch branch of
torchao's `_float8_addmm_impl` called directly: its own `preprocess_data`, `preprocess_scale` and
`addmm_float8_unwrapped_inference` on the quantized data and the weight's. That skips building two
tensor subclasses and dispatching through them on every call, about 100 us of host time a Linear,
which is what bounds a pipelined float8 step. With any other torchao version the quantized input is
wrapped as a `Float8Tensor` and passed, with the weight re-wrapped without its activation recipe, to
`F.linear`: torchao's dispatch then picks the kernel, as in its own call.

An activation can also arrive already quantized (`Quantized`): a row-wise op's kernel wrote torchao's
float8 of it (its quantizing epilogue) in place of the activation, for a Linear that `granularity`
said would quantize its input per row.

It applies only where torchao itself would take its torch quantization path: e4m3fn, PerRow over
the last dim or PerTensor, no value bounds, and a kernel preference that does not pick mslk's Triton
quantization (TORCH, or AUTO without mslk installed). A Linear whose call would run anything else
(hooks, an offload wrapper, a LoRA layer, another class) is the host's own call, and so is every call
under a torch.compile trace or the kill switch.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
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


@dataclass(frozen=True)
class Quantized:
    """An activation as torchao's float8 of it, (q, scale) with `granularity` scales, written by a
    fused kernel in place of its values (which no kernel wrote); `dense()` computes the activation
    itself, for a call that needs its values after all. q has the activation's shape."""

    q: torch.Tensor
    scale: torch.Tensor
    granularity: str
    dtype: torch.dtype
    dense: Callable[[], torch.Tensor]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def dense(x: torch.Tensor | Quantized) -> torch.Tensor:
    """x's values: x itself, or a quantized activation computed anew."""
    return x.dense() if isinstance(x, Quantized) else x


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
    ao = _torchao()
    kwargs = weight.act_quant_kwargs
    if kwargs is None or kwargs.float8_dtype != torch.float8_e4m3fn:
        return None
    if kwargs.hp_value_lb is not None or kwargs.hp_value_ub is not None:
        return None
    granularity = kwargs.granularity
    # PerRow over the last dim only: torchao applies the granularity to the activation, so another
    # dim (PerRow(1) on a [B, S, K] input) scales across tokens, not rows
    if type(granularity) is ao.PerRow and granularity.dim == -1:
        kind = "row"
    elif type(granularity) is ao.PerTensor:
        kind = "tensor"
    else:
        return None
    # torchao quantizes the input by the recipe's preference and picks the GEMM by the weight's: both
    # must be one that takes the torch path (not MSLK, not EMULATED, which its GEMM refuses)
    preference = kwargs.kernel_preference
    if preference not in (ao.KernelPreference.TORCH, ao.KernelPreference.AUTO):
        return None
    if weight.kernel_preference != preference:
        return None
    if preference == ao.KernelPreference.AUTO and kind == "row" and _installed(ao.utils._is_mslk_available):
        return None  # torchao quantizes with mslk's Triton kernel there: other arithmetic
    return kind, kwargs


@functools.cache
def _torchao() -> SimpleNamespace:
    """What this module uses of torchao, imported once (by the first float8 weight seen: torchao need
    not be installed): an import statement costs a Linear's call a microsecond or more each time."""
    import torchao
    import torchao.utils
    from torchao.float8.inference import (
        addmm_float8_unwrapped_inference,
        preprocess_data,
        preprocess_scale,
    )
    from torchao.quantization.granularity import PerRow, PerTensor
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import KernelPreference

    return SimpleNamespace(
        torchao=torchao,
        PerRow=PerRow,
        PerTensor=PerTensor,
        KernelPreference=KernelPreference,
        utils=torchao.utils,
        preprocess_data=preprocess_data,
        preprocess_scale=preprocess_scale,
        addmm=addmm_float8_unwrapped_inference,
    )


@functools.cache
def _installed(probe: Callable[[], bool]) -> bool:
    """torchao's probe for an optional package, asked once per process (it searches the import path
    on every call, which would cost more host time than the rest of a Linear's call)."""
    return probe()


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


def _quantized(x: torch.Tensor | Quantized, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized by the op, once per `shared` scope of x (a `Quantized` x as it came, in its
    granularity)."""
    if isinstance(x, Quantized):
        if x.granularity == granularity:
            return x.q, x.scale
        return float8_quant.apply(x.dense(), granularity)
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


def _direct_gemm(weight: Any, kind: str) -> bool:
    """Whether torchao's `_float8_addmm_impl` would take its torch branch for this weight with the
    activation scaled per `kind`, in the torchao version `_torch_gemm` mirrors (0.18): the weight
    scaled per row for "row" or per tensor for "tensor" (not 128x128 blocks) and a torch kernel
    choice (`_recipe` has declined mslk's)."""
    if not _torchao().torchao.__version__.startswith("0.18.") or weight.mm_config is None:
        return False
    # torchao's _is_rowwise_scaled / _is_tensorwise_scaled, read off qdata (the weight's shape)
    # rather than through the subclass, whose every attribute call dispatches
    shape, blocks = weight.qdata.shape, tuple(weight.block_size)
    if len(shape) != 2 or len(blocks) != 2:
        return False
    if kind == "row":
        return blocks == (1, shape[1])
    return all(b in (-1, n) for b, n in zip(blocks, shape, strict=True))


def _torch_gemm(
    q: torch.Tensor, scale: torch.Tensor, weight: Any, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """torchao 0.18's `_float8_addmm_impl(input, weight.t(), bias)` on its torch branch, for an input
    of `dtype` already quantized to (q, scale) (q has the input's shape): its own functions, called
    with the arguments it passes them (`weight.t()` holds `qdata.t()` and `scale.t()`)."""
    ao = _torchao()
    config = weight.mm_config
    qdata = weight.qdata
    data, w_data = ao.preprocess_data(q.reshape(-1, q.shape[-1]), qdata.t(), config)
    out = ao.addmm(
        data,
        ao.preprocess_scale(scale, q.shape),
        w_data,
        weight.scale.t(),
        output_dtype=dtype,
        bias=bias,
        use_fast_accum=config.use_fast_accum,
    )
    return out.reshape(*q.shape[:-1], qdata.shape[0])  # qdata's shape: weight.shape dispatches


def granularity(module: nn.Module) -> str | None:
    """How `linear` quantizes a plain `nn.Linear`'s input ("row" or "tensor", as torchao would), where
    it computes the call (a torchao float8 weight whose recipe `_recipe` accepts, no trace, no kill
    switch); None where the module's own call must run."""
    if torch.compiler.is_compiling() or runtime.kill_switch():
        return None  # first: a trace must not reach `_recipe`'s probes
    recipe = _recipe(module.weight)
    return None if recipe is None else recipe[0]


def linear(module: nn.Module, x: torch.Tensor | Quantized) -> torch.Tensor | None:
    """`module(x)` for a plain `nn.Linear` (the caller has checked nothing wraps it) holding a torchao
    float8 weight whose recipe `_recipe` accepts, with x quantized by the op (or as it came, a
    `Quantized`); None where the module's own call must run (on `dense(x)`)."""
    if torch.compiler.is_compiling() or runtime.kill_switch():
        return None  # first: a trace must not reach `_recipe`'s probes
    recipe = _recipe(module.weight)
    if recipe is None:
        return None
    plain = isinstance(x, torch.Tensor) and not x.requires_grad
    if not (plain or isinstance(x, Quantized)) or x.dtype != module.weight.dtype:
        return None
    granularity, kwargs = recipe
    weight = module.weight
    q, scale = _quantized(x, granularity)
    if _direct_gemm(weight, granularity):
        return _torch_gemm(q, scale, weight, module.bias, x.dtype)
    from torchao.quantization.utils import get_block_size

    quantized = type(module.weight)(
        q,
        scale,
        list(get_block_size(q.shape, kwargs.granularity)),
        kwargs.mm_config,
        None,
        kwargs.kernel_preference,
        x.dtype,
    )
    return F.linear(quantized, _bare_weight(weight), module.bias)
