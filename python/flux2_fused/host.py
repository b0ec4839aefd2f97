"""The host interface: what a model family's block code needs from the framework that owns the modules.

A *family* (FLUX.2 in `models/flux2/`) writes its blocks once, as functions of a block's modules. A
*host* (the package's own model, diffusers in `integrations/diffusers/`) owns those modules: their
classes, the hooks and wrappers on them, how its projections return, how its attention runs. The block
code never asks which host it runs in; it calls the host downward through this protocol, and the host
never calls back into the block code except by running a module whose forward is the family's.

A block is invoked by the family's loop: where `plain(block)` holds, the block code runs on the block's
modules with residual updates left pending between blocks; elsewhere the loop materializes the streams
and `call`s the block as the host would, so hooks, caches and offload wrappers around it run (a host
that wants those wrappers to run fused code too installs the family's block forward under them).
docs/architecture.md shows the interface and how a new host plugs in.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from . import float8_linear

# q, k, v [B, S, H, head_dim] (text rows first) -> attention output [B, S, H * head_dim].
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNormParameters(NamedTuple):
    """A q/k RMSNorm as the fused prologue computes it: its weight (None without one), eps (None: the
    dtype's machine epsilon, as PyTorch's) and arithmetic (`qk_norm_rope.reference.NORMS`): "fused"
    for `torch.nn.RMSNorm` (aten's fused kernel), "mean" for diffusers' `RMSNorm` module (the
    variance by pow and mean, rounded to the weight's dtype before the weight multiplies)."""

    weight: torch.Tensor | None
    eps: float | None
    norm: str = "fused"


@runtime_checkable
class Host(Protocol):
    """How the block code reaches the framework that owns a model's modules."""

    def plain(self, module: nn.Module) -> bool:
        """Whether the block code may compute `module`'s forward itself instead of calling it: the
        module is of a class whose forward the family reproduces, and nothing hooks or wraps it, so
        skipping its call changes nothing."""
        ...

    def call(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """The module's own call as the host runs it (hooks, wrappers, replaced forwards), on real
        tensors: for the modules the block code may not compute itself."""
        ...

    def linear(self, module: nn.Module, x: torch.Tensor | float8_linear.Quantized) -> torch.Tensor:
        """A projection's output, called as the host calls it, so LoRA layers, quantized linears and
        offload hooks run with the weights they hold at call time. x may come quantized where
        `float8_input` allowed it."""
        ...

    def float8_input(self, module: nn.Module) -> str | None:
        """The granularity ("row", "tensor") in which `linear(module, x)` quantizes x for torchao's
        float8 GEMM itself, where it also takes x already quantized (`float8_linear.Quantized`, made
        by a kernel's quantizing epilogue); None where it takes plain activations only."""
        ...

    def rms_norm(self, module: nn.Module) -> RMSNormParameters | None:
        """(weight, eps, arithmetic) of a plain q/k norm the block code may compute as `nn.RMSNorm`
        (or diffusers' own `RMSNorm` module) with that weight and eps (the fused prologue does); None
        where the module's own call must run. A host whose RMSNorm class differs from PyTorch's names
        it here."""
        ...

    def layer_norm(self, module: nn.Module) -> float | None:
        """The eps of a plain affine-free LayerNorm the block code may compute as aten's
        `layer_norm` (the fused norms do); None where the module's own call must run. A host whose
        LayerNorm class differs from PyTorch's names it here."""
        ...

    def attention(
        self, attn: nn.Module, options: Mapping[str, Any] | None, text_tokens: int
    ) -> Attention | None:
        """The attention `attn` computes on the block code's q, k, v, with the host's backend and
        parallel configuration; None where the attention module's own call must run instead (another
        processor, arguments the block code does not implement, hooks). `options` are the host's
        per-call attention arguments, `text_tokens` how many joint rows are text."""
        ...


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def class_named(cls: type, names: Collection[str]) -> str | None:
    """The first of `cls`'s classes along its MRO whose fully qualified name is in `names` (that
    name), None where none is: hosts find models by class, never by the bare class name, which two
    libraries' FLUX.2 transformers share."""
    return next((name for base in cls.__mro__ if (name := qualified_name(base)) in names), None)


def has_hooks(module: nn.Module) -> bool:
    """Whether calling `module` would run hooks (forward or backward, its own or global ones)."""
    hooks = torch.nn.modules.module
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or hooks._global_forward_hooks
        or hooks._global_forward_pre_hooks
        or hooks._global_backward_hooks
        or hooks._global_backward_pre_hooks
    )


# What a module's call runs besides hooks: its forward, and the `__call__` that calls it.
CALL_METHODS = ("forward", "__call__")
# (class, method names) -> (the functions it held under them when last looked at, whether all were
# its own)
_class_verdicts: dict[tuple[type, tuple[str, ...]], tuple[tuple[Any, ...], bool]] = {}
_warned_replacements: set[tuple[str, str]] = set()


def _package_root(module_name: str) -> Path | None:
    """The folder of the top-level package a module belongs to (diffusers/, torch/), None where the
    module is not a file-backed package (`__main__`, a module built at run time)."""
    top = sys.modules.get(module_name.partition(".")[0])
    paths = getattr(top, "__path__", None)
    return Path(next(iter(paths))).resolve() if paths else None


def _grad_mode_decorator_file() -> Path:
    """The file of torch's grad-mode decorators (`torch.no_grad()`, `enable_grad()`,
    `inference_mode()` used as decorators): they change no value a forward computes, unlike
    `torch.autocast` or `torch.compile`, which wrap functions too but change the arithmetic."""
    import torch.utils._contextlib as grad_modes

    return Path(grad_modes.__file__).resolve()


def _own_function(owner: type, fn: Any) -> bool:
    """Whether `fn`, found in `owner`'s own namespace, is the function `owner`'s package defined there:
    a function written in `owner`'s class body (its code's qualified name and file say so, which a
    replacement dressed up with `functools.wraps` cannot fake), under decorators of that package
    (diffusers' `apply_lora_scale`) or torch's grad-mode ones only. Any other layer is a replacement:
    a user's script, a cache or quantization tool patching the class, `torch.autocast(...)` or
    `torch.compile` around the method (both change its arithmetic), a non-function."""
    root = _package_root(owner.__module__)
    if root is None:
        return False
    # Decorators of the owner's package may wrap its methods, except torch's: its other wrappers
    # (autocast, compile) change what the method computes.
    own_decorators = root if root != _package_root("torch") else None
    grad_modes = _grad_mode_decorator_file()
    while (wrapped := getattr(fn, "__wrapped__", None)) is not None:
        code = getattr(fn, "__code__", None)
        if code is None:
            return False
        path = Path(code.co_filename).resolve()
        if not (path == grad_modes or (own_decorators is not None and path.is_relative_to(own_decorators))):
            return False
        fn = wrapped
    inner = fn
    if getattr(inner, "__code__", None) is None:
        return False
    # The code's own qualified name (Python >= 3.11); 3.10's code objects carry only the bare name.
    qualname = getattr(inner.__code__, "co_qualname", inner.__qualname__)
    module_file = getattr(sys.modules.get(owner.__module__), "__file__", None)
    return (
        inner.__module__ == owner.__module__
        and qualname.startswith(f"{owner.__qualname__}.")
        and qualname.rpartition(".")[2] == inner.__code__.co_name
        and module_file is not None
        and Path(inner.__code__.co_filename).resolve() == Path(module_file).resolve()
    )


def module_function(fn: Any, module_name: str) -> bool:
    """Whether `fn` is a function the module `module_name` defines, not a replacement put in its place
    (its code was compiled from that module's file, which `functools.wraps` cannot fake)."""
    module = sys.modules.get(module_name)
    code = getattr(fn, "__code__", None)
    path = getattr(module, "__file__", None)
    return (
        code is not None
        and path is not None
        and getattr(fn, "__module__", None) == module_name
        and Path(code.co_filename).resolve() == Path(path).resolve()
    )


# Verdicts of `functions_own`, by the function objects looked at (a replacement is another key).
_function_verdicts: dict[tuple[tuple[Any, str], ...], bool] = {}


@torch._dynamo.assume_constant_result
def functions_own(functions: tuple[tuple[Any, str], ...]) -> bool:
    """Whether each (function, module name) is that module's own function (`module_function`), kept
    per function objects (it reads files, once). A torch.compile trace takes it as a constant."""
    verdict = _function_verdicts.get(functions)
    if verdict is None:
        verdict = all(module_function(fn, name) for fn, name in functions)
        _function_verdicts[functions] = verdict
    return verdict


def _replacement(cls: type, names: tuple[str, ...]) -> tuple[str, Any] | None:
    """The first of `names` whose function along `cls`'s MRO is not its owner's own, with that
    function; None where every one is."""
    for name in names:
        owner = next((base for base in cls.__mro__ if name in base.__dict__), None)
        if owner is not None and not _own_function(owner, owner.__dict__[name]):
            return name, owner.__dict__[name]
    return None


def methods_unpatched(cls: type, names: tuple[str, ...] = CALL_METHODS) -> bool:
    """Whether the methods `names` of `cls` are still the ones its library wrote, not replaced on the
    class (TeaCache's `FluxTransformer2DModel.forward = teacache_forward`, or a patched block,
    feed-forward, processor or norm class). Block code stands in for a module's call only where
    they are: a replaced method must run, so its module is called instead. A replacement is warned
    about once, with what replaced it; the verdict is kept per class and looked at again whenever
    the class holds other functions (a patch applied or undone later)."""
    return _class_verdict(cls, names, tuple(getattr(cls, name, None) for name in names))


@torch._dynamo.assume_constant_result
def _class_verdict(cls: type, names: tuple[str, ...], current: tuple[Any, ...]) -> bool:
    """`methods_unpatched` given the functions `cls` holds now. A torch.compile trace takes the
    verdict as a constant (it reads files and warns), guarded by the functions it was given."""
    seen = _class_verdicts.get((cls, names))
    if seen is not None and seen[0] == current:
        return seen[1]
    replaced = _replacement(cls, names)
    _class_verdicts[(cls, names)] = (current, replaced is None)
    if replaced is not None:
        name, fn = replaced
        code = getattr(fn, "__code__", None)  # where the replacement was written, not what it claims
        what = (
            f"{getattr(code, 'co_qualname', code.co_name)} in {code.co_filename}"
            if code is not None
            else repr(fn)
        )
        if (qualified_name(cls), what) not in _warned_replacements:
            _warned_replacements.add((qualified_name(cls), what))
            warnings.warn(
                f"flux2-fused: {qualified_name(cls)}.{name} is replaced on the class (by {what}): "
                "its modules run the replacement, unfused; the modules it calls stay fused",
                RuntimeWarning,
                stacklevel=2,
            )
    return replaced is None


def unwrapped(module: nn.Module, own: tuple[type, ...] = ()) -> bool:
    """Whether skipping `module`'s call changes nothing: no hooks, no forward replaced on the
    instance (accelerate's offload and diffusers' cache hooks wrap `forward` that way) unless by one
    of the host's `own` forward types, and not compiled on its own (`module.compile()`, as diffusers'
    `compile_repeated_blocks` does)."""
    forward = module.__dict__.get("forward")
    return (
        not has_hooks(module)
        and (forward is None or isinstance(forward, own))
        and getattr(module, "_compiled_call_impl", None) is None
    )


def dropout_inactive(host: Host, module: nn.Module) -> bool:
    """A dropout the block code may skip: a plain `nn.Dropout` (not a subclass, which may do more)
    that changes nothing, p = 0 or in eval mode."""
    return type(module) is nn.Dropout and host.plain(module) and (module.p == 0 or not module.training)


def output_dropout_inactive(host: Host, attn: nn.Module) -> bool:
    """An attention module's output dropout is one the block code may skip: the double block keeps a
    parameter-free one at `to_out[1]` (diffusers, sglang); a `to_out` that is one Linear, or none
    (FLUX.1's pre-only attention), has none."""
    out = getattr(attn, "to_out", None)
    return not (isinstance(out, nn.ModuleList) and len(out) > 1) or dropout_inactive(host, out[1])


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """PyTorch's SDPA on [B, S, H, hd] tensors -> [B, S, H * hd], as diffusers' native backend runs it.

    The inputs are handed to SDPA as permuted [B, H, S, hd] views, not contiguous copies, exactly as
    diffusers' native backend does, so SDPA picks the same kernel and gives the same bits.
    """
    query, key, value = (t.permute(0, 2, 1, 3) for t in (query, key, value))
    out = F.scaled_dot_product_attention(query, key, value)
    return out.permute(0, 2, 1, 3).flatten(2, 3)


def call_arguments(parameters: Mapping[str, Any], args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """A host's forward's arguments by name with their defaults (`parameters`: its parameters in
    order, with defaults), None where Python would reject the call (too many, unknown or repeated
    arguments) or hidden_states, the one every forward requires, is missing."""
    names = list(parameters)
    if len(args) > len(names) or not set(kwargs) <= set(names[len(args) :]):
        return None
    settings = {**parameters, **dict(zip(names, args, strict=False)), **kwargs}
    return settings if len(args) > 0 or "hidden_states" in kwargs else None


class ModuleHost:
    """A host whose modules are plain PyTorch modules (the package's own model): a module is plain
    where it is of one of `classes` (those whose forward the family's block code reproduces) and
    nothing hooks or wraps it; modules and projections are called as modules, and attention is
    PyTorch's SDPA as diffusers' native backend runs it."""

    def __init__(self, classes: frozenset[type], own_forwards: tuple[type, ...] = ()) -> None:
        self.classes = classes
        self.own_forwards = own_forwards  # instance forwards the host put there itself

    def plain(self, module: nn.Module) -> bool:
        return (
            type(module) in self.classes
            and unwrapped(module, self.own_forwards)
            and methods_unpatched(type(module))
        )

    def call(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return module(*args, **kwargs)

    def linear(self, module: nn.Module, x: torch.Tensor | float8_linear.Quantized) -> torch.Tensor:
        """The module's call, or for a plain `nn.Linear` holding a torchao float8 weight the same
        output with the activation quantized by the `float8_quant` op, or as it came quantized
        (`float8_linear`)."""
        if self._float8_plain(module):
            out = float8_linear.linear(module, x)
            if out is not None:
                return out
        return module(float8_linear.dense(x))

    def float8_input(self, module: nn.Module) -> str | None:
        return float8_linear.granularity(module) if self._float8_plain(module) else None

    def _float8_plain(self, module: nn.Module) -> bool:
        """A plain `nn.Linear` (nothing wraps or hooks it) holding a torchao float8 weight."""
        float8 = float8_linear.is_float8(getattr(module, "weight", None)) and type(module) is nn.Linear
        return float8 and unwrapped(module, self.own_forwards) and methods_unpatched(nn.Linear)

    def rms_norm(self, module: nn.Module) -> RMSNormParameters | None:
        plain = type(module) is nn.RMSNorm and self.plain(module)
        return RMSNormParameters(module.weight, module.eps) if plain else None

    def layer_norm(self, module: nn.Module) -> float | None:
        plain = type(module) is nn.LayerNorm and not module.elementwise_affine and self.plain(module)
        return module.eps if plain else None

    def attention(
        self, attn: nn.Module, options: Mapping[str, Any] | None, text_tokens: int
    ) -> Attention | None:
        return sdpa if not options and self.plain(attn) else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.classes)} plain classes)"
