"""The fused path on diffusers' own FLUX.2 modules: `enable(transformer or pipeline)`.

    from flux2_fused.integrations.diffusers import enable
    handle = enable(pipe)               # or enable(pipe.transformer); outputs stay bit-identical
    ...
    handle.disable()                    # diffusers' own forward again

`enable` replaces `Flux2Transformer2DModel.forward` on the instance with a loop over the model's own
submodules that runs each block through the package's block code (`models/blocks.py`), which is
diffusers' eager computation with each fusable site sent to its fused op. Nothing is copied or
snapshotted: every Linear is called as a module at call time, so LoRA layers (peft), quantized
linears, weight replacements, dtype and device moves act exactly as in diffusers.

Each call decides what it can vouch for, from the module state at that moment:
- attention through diffusers' default processors runs the block code (the fused q/k prologue) and
  hands q, k, v to diffusers' own `dispatch_attention_fn` with the processor's backend and parallel
  config: every attention backend, and context parallelism (the exchange between ranks happens in
  there), stay fused;
- hooks that wrap the transformer's forward and end in the class's forward (accelerate's offload
  hook, diffusers' hook registry: context-parallel input splitting, caches) keep running around the
  fused forward, which takes the class forward's place at the bottom, whichever came first;
- `joint_attention_kwargs`: a LoRA "scale" scales the adapters for the call, as diffusers does;
  other keys go to each attention call, which then runs as diffusers' own;
- KV-cache editing ("extract" and "cached" modes) runs as diffusers' forward does, each block in
  the block code, the fused prologue's q, k, v handed to diffusers' KV attention (stored, or
  injected from the cache); the per-token modulation of "extract" declines to the eager chain;
- the whole call takes diffusers' forward for what the loop does not implement: gradient
  checkpointing while a gradient is needed, a forward wrapper of unknown kind on the instance, hooks
  on the transformer's own top-level modules that the loop bypasses (`norm_out`);
- a block whose attention runs another processor, or whose norms, attention or feed-forward carry
  hooks or a wrapped forward, runs through diffusers' own block call; the other blocks stay fused;
- everything the fused ops cannot prove exact (CPU, fp32, autograd, ...) declines inside them to
  the eager chain, as in the package's own model.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..models.blocks import (
    Blend,
    bypassable,
    conditioning,
    double_attention,
    double_block,
    feed_forward,
    output_norm,
    parallel_attention,
    single_block,
    transformer,
)
from ..models.deferral import Fusion, Stream, materialize, stream_dtype

SUPPORTED_DIFFUSERS = ((0, 37), (0, 43))  # [min, max): the FLUX.2 transformer's math is unchanged here
CLASS_NAME = "Flux2Transformer2DModel"


@functools.cache
def check_version() -> str:
    """The installed diffusers version; RuntimeError when it is missing or outside the range whose
    FLUX.2 transformer the patch follows. Looked up once (enable() is called per benchmark step)."""
    try:
        version = importlib.metadata.version("diffusers")
    except importlib.metadata.PackageNotFoundError as err:
        raise RuntimeError("flux2-fused: diffusers is not installed") from err
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    low, high = SUPPORTED_DIFFUSERS
    if not (low <= parts < high):
        raise RuntimeError(
            f"flux2-fused: diffusers {version} is outside the supported range "
            f">={low[0]}.{low[1]},<{high[0]}.{high[1]} (FLUX.2's transformer may differ there)"
        )
    return version


@dataclass
class FusedHandle:
    """What `enable` returns: the switch of the patched transformer, and `disable()` to undo it.

    `fusion.fused = False` keeps the patch but runs every site eager (for A/B comparisons). `method`
    is the fused forward bound to the transformer, wherever it sits in the forward's wrappers;
    `previous_forward` is a forward of unknown kind that was set on the instance before `enable`
    (every call then goes through it, unfused), restored by `disable`.
    """

    transformer: nn.Module
    fusion: Fusion
    method: Any
    previous_forward: Any = None

    def disable(self) -> None:
        """Restore the transformer's forward as it was before `enable`, wrappers added since kept."""
        transformer = self.transformer
        for holder, name in _forward_slots(transformer):
            if getattr(holder, name) is not self.method:
                continue
            if holder is transformer and name == "forward":
                del transformer.__dict__["forward"]
                if self.previous_forward is not None:
                    transformer.forward = self.previous_forward
            else:
                setattr(holder, name, types.MethodType(type(transformer).forward, transformer))
            break
        transformer._flux2_fused_handle = None


def _forward_slots(transformer: nn.Module) -> list[tuple[Any, str]]:
    """The places that hold a forward of the transformer, outermost first: the instance's own
    `forward`, accelerate's `_old_forward` (what its hook calls: model CPU offload, device maps),
    and the function references of diffusers' hook registry (each hook calls the next one down, the
    last the module's forward: context-parallel splitting, caches, group offloading).
    Only slots that hold something are listed."""
    slots = [(transformer, "forward"), (transformer, "_old_forward")]
    registry = getattr(transformer, "_diffusers_hook", None)
    for ref in reversed(getattr(registry, "_fn_refs", [])):
        # A hook with its own `new_forward` keeps what it calls in `original_forward`.
        slots += [(ref, "forward"), (ref, "original_forward")]
    return [(holder, name) for holder, name in slots if getattr(holder, name, None) is not None]


def _binds_class_forward(fn: Any, transformer: nn.Module) -> bool:
    bound_to = getattr(fn, "__self__", None)
    return bound_to is transformer and getattr(fn, "__func__", None) is type(transformer).forward


def _attention_plain(attn: nn.Module) -> bool:
    """The attention module's forward may be replaced by the block code (its processor aside):
    unfused projections, no hooks, the parameter-free dropout of `to_out` (diffusers keeps one at
    index 1 in the double block) inactive."""
    if not bypassable(attn):
        return False
    if getattr(attn, "fused_projections", False):
        return False
    out = attn.to_out
    if isinstance(out, nn.ModuleList) and len(out) > 1:
        dropout = out[1]
        if not (
            isinstance(dropout, nn.Dropout)
            and bypassable(dropout)
            and (dropout.p == 0 or not dropout.training)
        ):
            return False
    return True


def _dispatch(processor: Any) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The attention of a default processor: diffusers' `dispatch_attention_fn` with the processor's
    backend and parallel config, on the q, k, v the block code computed (the same tensors, shapes and
    strides the processor would pass), flattened and cast as the processor does. A context-parallel
    config exchanges rows with the other ranks in there, as in diffusers."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        out = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=None,
            backend=processor._attention_backend,
            parallel_config=processor._parallel_config,
        )
        return out.flatten(2, 3).to(query.dtype)

    return sdpa


# The attention arguments diffusers' forward itself passes in KV-cache editing.
KV_ARGUMENTS = frozenset({"kv_cache", "kv_cache_mode", "num_ref_tokens", "num_txt_tokens"})


def _kv_dispatch(
    processor: Any, kv_cache: Any, kv_cache_mode: str | None, num_ref_tokens: int, num_txt_tokens: int
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The attention of diffusers' KV processors on the q, k, v the block code computed, as they
    run it: in "extract" mode the reference rows' K/V stored in the layer's cache and the reference
    rows attending only to themselves, in "cached" mode the stored K/V injected between the text and
    image rows; without KV arguments the default processor's dispatch."""
    from diffusers.models.transformers.transformer_flux2 import _flux2_kv_causal_attention

    plain = _dispatch(processor)
    refs, txt = num_ref_tokens, num_txt_tokens

    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if kv_cache_mode == "extract" and kv_cache is not None and refs > 0:
            kv_cache.store(key[:, txt : txt + refs].clone(), value[:, txt : txt + refs].clone())
        if kv_cache_mode == "extract" and refs > 0:
            out = _flux2_kv_causal_attention(
                query, key, value, txt, refs, backend=processor._attention_backend
            )
        elif kv_cache_mode == "cached" and kv_cache is not None:
            out = _flux2_kv_causal_attention(
                query, key, value, txt, 0, kv_cache=kv_cache, backend=processor._attention_backend
            )
        else:
            return plain(query, key, value)
        return out.flatten(2, 3).to(query.dtype)

    return sdpa


def _block_sdpa(
    attn: nn.Module, default: str, kv: str, kwargs: dict | None, txt_tokens: int
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The attention the block code runs for `attn` with these arguments, or None where diffusers'
    own attention call must run: a processor other than diffusers' default (class `default`) or KV
    one (class `kv`, where this diffusers has it), arguments other than the KV ones diffusers' forward
    passes, or a module the block code may not bypass. The default processor drops KV arguments, as
    diffusers' attention module does for a processor that does not take them."""
    from diffusers.models.transformers import transformer_flux2

    kwargs = kwargs or {}
    if not (set(kwargs) <= KV_ARGUMENTS and _attention_plain(attn)):
        return None
    processor = attn.processor
    if type(processor) is getattr(transformer_flux2, default):
        return _dispatch(processor)
    if type(processor) is getattr(transformer_flux2, kv, None):
        return _kv_dispatch(
            processor,
            kwargs.get("kv_cache"),
            kwargs.get("kv_cache_mode"),
            kwargs.get("num_ref_tokens", 0),
            txt_tokens,
        )
    return None


def _norms_plain(block: nn.Module, names: tuple[str, ...]) -> bool:
    """The block's LayerNorms are plain affine-free LayerNorms the fused sites may replace."""
    for name in names:
        norm = getattr(block, name)
        if type(norm) is not nn.LayerNorm or norm.elementwise_affine or not bypassable(norm):
            return False
    return True


def _ff_plain(ff: nn.Module) -> bool:
    from diffusers.models.transformers.transformer_flux2 import Flux2FeedForward, Flux2SwiGLU

    return (
        type(ff) is Flux2FeedForward
        and bypassable(ff)
        and type(ff.act_fn) is Flux2SwiGLU
        and bypassable(ff.act_fn)
    )


def _call_attention(
    attn: nn.Module, fusion: Fusion, x: torch.Tensor, c: torch.Tensor, rope: Any, **kwargs: Any
) -> Any:
    """diffusers' own attention call (its processor, its hooks, KV-cache arguments) inside an
    otherwise fused block."""
    return attn(hidden_states=x, encoder_hidden_states=c, image_rotary_emb=rope, **kwargs)


def _call_parallel_attention(
    attn: nn.Module, fusion: Fusion, h: torch.Tensor, rope: Any, **kwargs: Any
) -> Any:
    return attn(hidden_states=h, image_rotary_emb=rope, **kwargs)


def _call_ff(ff: nn.Module, fusion: Fusion, x: torch.Tensor) -> torch.Tensor:
    return ff(x)


def _feed_forward(ff: nn.Module, fusion: Fusion, x: torch.Tensor) -> torch.Tensor:
    """The block code's SwiGLU MLP where `ff` is diffusers' plain one, else its own call."""
    return feed_forward(ff, fusion, x) if _ff_plain(ff) else _call_ff(ff, fusion, x)


def _run_double(
    block: nn.Module,
    fusion: Fusion,
    x: Stream,
    c: Stream,
    mod_img: torch.Tensor,
    mod_txt: torch.Tensor,
    rope: Any,
    attn_kwargs: dict | None = None,
    txt_tokens: int = 0,
) -> tuple[Stream, Stream]:
    """One double block: the block code where the block is plain, with diffusers' attention call
    where the block code cannot run its attention (`_block_sdpa`), else the block's own call."""
    if not (bypassable(block) and _norms_plain(block, ("norm1", "norm1_context", "norm2", "norm2_context"))):
        c_out, x_out = block(
            hidden_states=materialize(x),
            encoder_hidden_states=materialize(c),
            temb_mod_img=mod_img,
            temb_mod_txt=mod_txt,
            image_rotary_emb=rope,
            joint_attention_kwargs=attn_kwargs,
        )
        return x_out, c_out
    sdpa = _block_sdpa(block.attn, "Flux2AttnProcessor", "Flux2KVAttnProcessor", attn_kwargs, txt_tokens)
    if sdpa is not None:
        attend = functools.partial(double_attention, sdpa=sdpa)
    else:
        attend = functools.partial(_call_attention, **(attn_kwargs or {}))
    return double_block(block, fusion, x, c, mod_img, mod_txt, rope, attend=attend, mlp=_feed_forward)


def _run_single(
    block: nn.Module, fusion: Fusion, h: Stream, mod: torch.Tensor, rope: Any, attn_kwargs: dict | None = None
) -> Stream:
    """One single block, chosen like `_run_double`."""
    from diffusers.models.transformers.transformer_flux2 import Flux2SwiGLU

    if not (bypassable(block) and _norms_plain(block, ("norm",))):
        return block(
            hidden_states=materialize(h),
            encoder_hidden_states=None,
            temb_mod=mod,
            image_rotary_emb=rope,
            joint_attention_kwargs=attn_kwargs,
        )
    attn = block.attn
    txt_tokens = (attn_kwargs or {}).get("num_txt_tokens", 0)  # the single KV processor's own default
    sdpa = _block_sdpa(
        attn, "Flux2ParallelSelfAttnProcessor", "Flux2KVParallelSelfAttnProcessor", attn_kwargs, txt_tokens
    )
    if sdpa is not None and type(attn.mlp_act_fn) is Flux2SwiGLU and bypassable(attn.mlp_act_fn):
        attend = functools.partial(parallel_attention, sdpa=sdpa)
    else:
        attend = functools.partial(_call_parallel_attention, **(attn_kwargs or {}))
    return single_block(block, fusion, h, mod, rope, attend=attend)


def _run_output(norm_out: nn.Module, fusion: Fusion, rows: Stream, temb: torch.Tensor) -> torch.Tensor:
    """The output norm by the block code (the forward checked that norm_out is plain)."""
    return output_norm(norm_out, fusion, rows, temb, stream_dtype(rows))


def _top_level_plain(model: nn.Module) -> bool:
    """The modules the loop calls in its own order, or bypasses (norm_out's norm), are unwrapped."""
    from diffusers.models.normalization import AdaLayerNormContinuous

    norm_out = model.norm_out
    if type(norm_out) is not AdaLayerNormContinuous or not bypassable(norm_out):
        return False
    norm = norm_out.norm
    plain_norm = type(norm) is nn.LayerNorm and not norm.elementwise_affine and bypassable(norm)
    return plain_norm and type(norm_out.silu) is nn.SiLU and bypassable(norm_out.silu)


def _reference_blend(
    model: nn.Module, image_tokens: int, txt_tokens: int, num_ref_tokens: int, ref_fixed_timestep: float
) -> Blend:
    """KV-cache extraction with reference rows, as diffusers' forward does it: the reference rows'
    own modulation (at a fixed timestep) blended per token into the image and joint modulations."""
    from diffusers.models.transformers.transformer_flux2 import (
        _blend_double_block_mods,
        _blend_single_block_mods,
    )

    def blend(
        timestep: torch.Tensor, guidance: torch.Tensor | None, mod_img: torch.Tensor, mod_single: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ref_temb = model.time_guidance_embed(torch.full_like(timestep, ref_fixed_timestep * 1000), guidance)
        ref_mod_img = model.double_stream_modulation_img(ref_temb)
        ref_mod_single = model.single_stream_modulation(ref_temb)
        return (
            _blend_double_block_mods(mod_img, ref_mod_img, num_ref_tokens, image_tokens),
            _blend_single_block_mods(
                mod_single, ref_mod_single, txt_tokens, num_ref_tokens, txt_tokens + image_tokens
            ),
        )

    return blend


def _attention_kwargs(
    model: nn.Module,
    extra: dict | None,
    kv_cache: Any,
    mode: str | None,
    num_ref_tokens: int,
    txt_tokens: int,
) -> tuple[list[dict | None], list[dict | None]]:
    """Each double and single block's attention arguments, as diffusers' forward builds them: the
    caller's `joint_attention_kwargs` (less the LoRA scale), plus in KV modes the mode, the number
    of reference rows, each layer's cache entry and, for single blocks, the number of text rows."""
    base = extra
    if mode == "extract" or (mode == "cached" and kv_cache is not None):
        refs = num_ref_tokens if mode == "extract" else kv_cache.num_ref_tokens
        base = {**(extra or {}), "kv_cache": None, "kv_cache_mode": mode, "num_ref_tokens": refs}
    single = {**(base or {}), "num_txt_tokens": txt_tokens} if mode is not None else base
    with_cache = mode is not None and kv_cache is not None
    double_kwargs = [
        {**base, "kv_cache": kv_cache.get_double(i)} if with_cache else base
        for i in range(len(model.transformer_blocks))
    ]
    single_kwargs = [
        {**single, "kv_cache": kv_cache.get_single(i)} if with_cache else single
        for i in range(len(model.single_transformer_blocks))
    ]
    return double_kwargs, single_kwargs


@contextlib.contextmanager
def _lora_scale(model: nn.Module, joint_attention_kwargs: dict | None) -> Iterator[dict | None]:
    """diffusers' `apply_lora_scale` around its forward: a "scale" in `joint_attention_kwargs`
    scales every peft LoRA layer for the call; the rest goes on to the attention calls."""
    from diffusers.utils import USE_PEFT_BACKEND, scale_lora_layers, unscale_lora_layers

    extra = None
    scale = 1.0
    if joint_attention_kwargs is not None:
        extra = dict(joint_attention_kwargs)
        scale = extra.pop("scale", 1.0)
    if USE_PEFT_BACKEND:
        scale_lora_layers(model, scale)
    try:
        yield extra
    finally:
        if USE_PEFT_BACKEND:
            unscale_lora_layers(model, scale)


# diffusers' forward's parameters after `guidance`, in order (a caller may pass them positionally),
# with their defaults.
FORWARD_TAIL = {
    "joint_attention_kwargs": None,
    "return_dict": True,
    "kv_cache": None,
    "kv_cache_mode": None,
    "num_ref_tokens": 0,
    "ref_fixed_timestep": 0.0,
}


def _fused_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor = None,
    timestep: torch.Tensor = None,
    img_ids: torch.Tensor = None,
    txt_ids: torch.Tensor = None,
    guidance: torch.Tensor = None,
    *tail: Any,
    **options: Any,
) -> Any:
    """diffusers' forward, computed by the package's block code on diffusers' modules where that is
    provably the same, and by diffusers itself everywhere else (see the module docstring).

    The parameters after `guidance` are taken as diffusers' forward takes them, positionally or by
    keyword, because its LoRA scaling reads `joint_attention_kwargs` only when passed by keyword.
    Bound to the transformer as a method, so a `copy.deepcopy` of the module binds the copy."""
    handle: FusedHandle | None = getattr(self, "_flux2_fused_handle", None)
    names = list(FORWARD_TAIL)
    well_formed = len(tail) <= len(names) and set(options) <= set(names[len(tail) :])
    settings = {**FORWARD_TAIL, **dict(zip(names, tail, strict=False)), **options}  # tail may be short
    mode, kv_cache = settings["kv_cache_mode"], settings["kv_cache"]
    if (
        handle is None  # the handle was disabled while this method stayed reachable (another wrapper)
        or handle.previous_forward is not None
        or not well_formed  # diffusers' own forward raises Python's error
        or mode not in (None, "extract", "cached")
        # diffusers raises for a "cached" call without a cache or attention arguments
        or (mode == "cached" and kv_cache is None and settings["joint_attention_kwargs"] is None)
        or (torch.is_grad_enabled() and getattr(self, "gradient_checkpointing", False))
        or not _top_level_plain(self)
    ):
        original = (handle and handle.previous_forward) or types.MethodType(type(self).forward, self)
        return original(
            hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, guidance, *tail, **options
        )
    num_ref_tokens = settings["num_ref_tokens"]
    with _lora_scale(self, options.get("joint_attention_kwargs")) as extra:
        if "joint_attention_kwargs" not in options:  # passed positionally (or not at all): goes on whole
            extra = settings["joint_attention_kwargs"]
        txt_tokens = encoder_hidden_states.shape[1]
        leading_rows = txt_tokens
        blend = None
        if mode == "extract" and num_ref_tokens > 0:  # a new cache, the reference rows' modulation
            from diffusers.models.transformers.transformer_flux2 import Flux2KVCache

            kv_cache = Flux2KVCache(len(self.transformer_blocks), len(self.single_transformer_blocks))
            kv_cache.num_ref_tokens = num_ref_tokens
            blend = _reference_blend(
                self, hidden_states.shape[1], txt_tokens, num_ref_tokens, settings["ref_fixed_timestep"]
            )
            leading_rows += num_ref_tokens
        cond = conditioning(
            self, hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, guidance, blend=blend
        )
        double_kwargs, single_kwargs = _attention_kwargs(
            self, extra, kv_cache, mode, num_ref_tokens, txt_tokens
        )
        out = transformer(
            self,
            handle.fusion,
            cond,
            run_double=lambda i, block, *args: _run_double(
                block, *args, attn_kwargs=double_kwargs[i], txt_tokens=txt_tokens
            ),
            run_single=lambda i, block, *args: _run_single(block, *args, attn_kwargs=single_kwargs[i]),
            run_output=_run_output,
            leading_rows=leading_rows,
        )
    from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModelOutput

    return_dict = settings["return_dict"]
    if mode == "extract":  # the new cache is returned alongside, as diffusers does
        return Flux2Transformer2DModelOutput(out, kv_cache) if return_dict else (out, kv_cache)
    return Flux2Transformer2DModelOutput(sample=out) if return_dict else (out,)


def enable(model: Any, fused: bool = True) -> FusedHandle:
    """Patch a diffusers Flux2Transformer2DModel, or a pipeline's `.transformer`, in place; returns
    a handle. Enabling twice returns the same handle."""
    check_version()
    transformer = getattr(model, "transformer", model)
    if type(transformer).__name__ != CLASS_NAME:
        raise TypeError(
            f"flux2-fused: expected a diffusers {CLASS_NAME} or a pipeline holding one, "
            f"got {type(model).__name__}"
        )
    existing = getattr(transformer, "_flux2_fused_handle", None)
    if existing is not None:
        if any(getattr(holder, name) is existing.method for holder, name in _forward_slots(transformer)):
            return existing
        transformer._flux2_fused_handle = None  # replaced from outside since: install afresh
    method = types.MethodType(_fused_forward, transformer)
    # Under wrappers that end in the class's forward (accelerate's and diffusers' hooks), the fused
    # forward takes its place there, so the wrappers run around it; a wrapper of unknown kind stays
    # outermost and is called whole (unfused).
    for holder, name in _forward_slots(transformer):
        if _binds_class_forward(getattr(holder, name), transformer):
            setattr(holder, name, method)
            previous = None
            break
    else:
        previous = transformer.__dict__.get("forward")
        transformer.forward = method
    handle = FusedHandle(transformer, Fusion(fused=fused), method, previous)
    transformer._flux2_fused_handle = handle
    return handle
