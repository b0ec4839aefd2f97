"""ComfyUI as a host of the block code: its FLUX modules, its ops' norms, its attention function.

A `ComfyHost` implements `flux2_fused.host.Host` for ComfyUI's `comfy.ldm.flux` model:
- ComfyUI's blocks name their submodules otherwise than diffusers (`img_attn.qkv`, `txt_mlp`,
  `linear1`), so the family's ComfyUI binding hands the block code `View`s: namespaces that carry
  diffusers' names for ComfyUI's modules, and stand for the modules they cover. A view is plain
  where every module it covers is;
- a module is plain where it is one of ComfyUI's FLUX classes (or a PyTorch container or
  activation), nothing hooks it and its class's methods are ComfyUI's own;
- norms are `comfy.ops` classes (one per weight-handling mode: `disable_weight_init`,
  `manual_cast`, ComfyUI's fp8 and mixed-precision ops subclass them): `layer_norm` vouches for an
  affine-free one, `rms_norm` for a q/k RMSNorm that uses its own weight as it is (no per-call cast,
  stream or patch: those run as module calls);
- its RoPE is `apply_rope`, comfy-kitchen's where installed: `rope_rotation` says which of the fused
  prologue's rotations computes it on this installation, if any (docs/numerics.md, 12);
- projections are the modules' own calls, so ComfyUI's LoRA weight functions, casts and fp8 scaled
  weights run as in ComfyUI;
- the attention is ComfyUI's `optimized_attention` as `comfy.ldm.flux.math` finds it, with the
  block's transformer options, handed q, k, v as [B, H, S, hd] views (see `attention` for which of
  ComfyUI's attentions that is checked with).
The binding (`flux2_fused.models.flux2.comfyui`) runs a model's call on the block code only where all
of it is plain, so `call` never has to run a view.
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ...host import Attention, ModuleHost, RMSNormParameters, functions_own, methods_unpatched, unwrapped

FLUX_MATH = "comfy.ldm.flux.math"
FLUX_LAYERS = "comfy.ldm.flux.layers"
# PyTorch modules the block code computes itself where nothing wraps them: the activations and the
# MLPs' `nn.Sequential` containers.
TORCH_CLASSES = frozenset({nn.SiLU, nn.GELU, nn.Sequential})


class View:
    """ComfyUI modules under the names the family's block code reads (`norm1`, `attn.to_qkv`,
    `ff.linear_in`, ...). `modules` are the ComfyUI modules whose forwards the view's user replaces:
    the view is plain where each of them is."""

    def __init__(self, modules: tuple[nn.Module, ...], **names: Any) -> None:
        self.modules = modules
        self.__dict__.update(names)

    def __repr__(self) -> str:
        return f"View({', '.join(type(m).__name__ for m in self.modules)})"


def flux_math_unpatched() -> bool:
    """ComfyUI's FLUX attention path is its own: the blocks' `attention` and the `apply_rope` it calls
    are `comfy.ldm.flux.math`'s functions. A tool that replaces either (a custom attention or RoPE)
    is honored: the blocks then run ComfyUI's own forward."""
    math, layers = sys.modules.get(FLUX_MATH), sys.modules.get(FLUX_LAYERS)
    if math is None or layers is None:
        return False
    functions = (layers.attention, math.attention, math.apply_rope)
    return functions_own(tuple((fn, FLUX_MATH) for fn in functions))


# ComfyUI's attention functions checked with the node's [B, H, S, hd] views: PyTorch's SDPA (its
# default on NVIDIA GPUs) and its torch-op fallbacks (the CPU's sub-quadratic one, split, basic).
CHECKED_ATTENTION = ("attention_pytorch", "attention_sub_quad", "attention_split", "attention_basic")


def checked_attention() -> bool:
    """Whether ComfyUI's `optimized_attention` is one of CHECKED_ATTENTION, ComfyUI's own function."""
    fn = getattr(sys.modules.get(FLUX_MATH), "optimized_attention", None)
    inner = getattr(fn, "__wrapped__", fn)  # under ComfyUI's `wrap_attn`
    return getattr(inner, "__name__", None) in CHECKED_ATTENTION and functions_own(
        ((inner, "comfy.ldm.modules.attention"),)
    )


# comfy-kitchen versions whose CUDA RoPE kernel the prologue's "kitchen" rotation reproduces: read
# from its compiled code and checked against it on the GPU (docs/numerics.md, 12). Another version
# may compile otherwise, so its RoPE runs as ComfyUI runs it.
KITCHEN_VERSIONS = frozenset({"0.2.26"})


@functools.cache
def _kitchen_version() -> str | None:
    try:
        return importlib.metadata.version("comfy-kitchen")
    except importlib.metadata.PackageNotFoundError:
        return None


def rope_rotation(dtype: torch.dtype, pe: torch.Tensor) -> str | None:
    """The fused prologue's rotation (`qk_norm_rope.reference.ROTATIONS`) that computes ComfyUI's
    `apply_rope` of q, k of `dtype` by its rotation matrices `pe` on CUDA, as this installation
    dispatches it: comfy-kitchen's CUDA kernel ("kitchen", for the versions in KITCHEN_VERSIONS), or
    torch's ops (comfy-kitchen's eager backend, ComfyUI's own in training mode: "addcmul"). None
    where neither runs (another backend or version, comfy-kitchen's `apply_rope` replaced, the CPU, a
    torch.compile trace, fp32 rows or tables): ComfyUI's `apply_rope` then rotates."""
    if torch.compiler.is_compiling() or pe.device.type != "cuda" or pe.dtype != torch.float32:
        return None
    if dtype not in (torch.bfloat16, torch.float16) or not flux_math_unpatched():
        return None
    management, quant_ops = sys.modules.get("comfy.model_management"), sys.modules.get("comfy.quant_ops")
    if getattr(management, "in_training", False):  # `comfy.ldm.flux.math._apply_rope`: torch
        math = sys.modules[FLUX_MATH]
        own = functions_own(
            tuple((fn, FLUX_MATH) for fn in (math._apply_rope, math.apply_rope1, math._apply_rope1))
        )
        return "addcmul" if own else None
    kitchen = getattr(quant_ops, "ck", None)
    if kitchen is None or not functions_own(((kitchen.apply_rope, "comfy_kitchen"),)):
        return None  # no comfy-kitchen (ComfyUI's RoPE would fail), or its apply_rope replaced
    stand_in = torch.empty((0, 0, 0, 0), dtype=dtype, device=pe.device)
    try:
        backend = kitchen.registry.get_capable_backend(
            "apply_rope", {"xq": stand_in, "xk": stand_in, "freqs_cis": pe}
        )
    except Exception:  # no backend takes it: ComfyUI's call would fail alike
        return None
    if backend == "eager":
        return "addcmul"
    return "kitchen" if backend == "cuda" and _kitchen_version() in KITCHEN_VERSIONS else None


class ComfyHost(ModuleHost):
    """The ComfyUI host (see the module docstring): `classes` are ComfyUI's FLUX classes whose
    forward the block code reproduces; `layer_norm_class` and `rms_norm_class` are `comfy.ops`'
    LayerNorm and RMSNorm bases (`disable_weight_init.LayerNorm`, `.RMSNorm`)."""

    def __init__(self, classes: frozenset[type], layer_norm_class: type, rms_norm_class: type) -> None:
        super().__init__(TORCH_CLASSES | classes)
        self.layer_norm_class = layer_norm_class
        self.rms_norm_class = rms_norm_class

    def plain(self, module: nn.Module | View) -> bool:
        if isinstance(module, View):
            return all(self.plain(m) for m in module.modules)
        return super().plain(module)

    def _op_plain(self, module: nn.Module, base: type) -> bool:
        """A `comfy.ops` module of `base`'s family computes its PyTorch class's forward: nothing hooks
        it, its class's methods are ComfyUI's, and no weight or bias function patches it per call."""
        return (
            isinstance(module, base)
            and unwrapped(module)
            and methods_unpatched(type(module))
            and not getattr(module, "weight_function", None)
            and not getattr(module, "bias_function", None)
        )

    def layer_norm(self, module: nn.Module) -> float | None:
        if self._op_plain(module, self.layer_norm_class) and module.weight is None and module.bias is None:
            return module.eps
        return super().layer_norm(module)

    def rms_norm(self, module: nn.Module) -> RMSNormParameters | None:
        """A `comfy.ops` RMSNorm computes `F.rms_norm` with its own weight where it casts nothing per
        call (`comfy_cast_weights` off, no weight function) and the weight is a plain tensor; its
        eps None is aten's default, float32's machine epsilon, whatever the rows' dtype."""
        if (
            self._op_plain(module, self.rms_norm_class)
            and not module.comfy_cast_weights
            and type(module.weight) in (nn.Parameter, torch.Tensor)
        ):
            eps = torch.finfo(torch.float32).eps if module.eps is None else module.eps
            return RMSNormParameters(module.weight, eps)
        return super().rms_norm(module)

    def attention(
        self, attn: nn.Module | View, options: Mapping[str, Any] | None, text_tokens: int
    ) -> Attention | None:
        """ComfyUI's `optimized_attention` (as its FLUX blocks find it, with the block's transformer
        options) on q, k, v [B, S, H, hd] handed over as [B, H, S, hd] views -> [B, S, H * hd].
        ComfyUI's blocks pass contiguous [B, H, S, hd] tensors: the same values in other strides,
        which PyTorch's SDPA and ComfyUI's torch-op attentions take to the same bits (checked on
        the H200 and the CPU). None where the attention module is not plain, a tool replaced
        ComfyUI's FLUX attention functions, an attention override is set, or ComfyUI picked an
        attention library (sage, flash-attn, xformers) not checked with those strides."""
        transformer_options = {} if options is None else options
        if (
            not self.plain(attn)
            or not flux_math_unpatched()
            or "optimized_attention_override" in transformer_options
            or not checked_attention()
        ):
            return None
        optimized_attention = sys.modules[FLUX_MATH].optimized_attention

        def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            q, k, v = (t.transpose(1, 2) for t in (query, key, value))
            return optimized_attention(
                q, k, v, q.shape[1], skip_reshape=True, mask=None, transformer_options=transformer_options
            )

        return attend

    def call(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """A module's own call; a view is never called (the binding runs a call on the block code
        only where every view is plain), so reaching one here fails loudly instead of computing
        something else."""
        if isinstance(module, View):
            raise RuntimeError(f"flux2-fused: {module!r} called: ComfyUI's blocks take other arguments")
        return module(*args, **kwargs)

    def __repr__(self) -> str:
        return f"ComfyHost({len(self.classes)} plain classes)"
