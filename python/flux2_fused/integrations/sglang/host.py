"""sglang as a host of the block code: its FLUX.2 DiT's modules, its Linears, its attention layer.

An `SglangHost` implements `flux2_fused.host.Host` for sglang's `Flux2Transformer2DModel`
(`sglang.multimodal_gen.runtime.models.dits.flux_2`), whose submodules carry diffusers' names and
compute diffusers' arithmetic on the CPU, but are sglang's own classes:
- a module is plain where it is one of the family's sglang classes (or a PyTorch norm, activation or
  dropout) and nothing hooks or wraps it;
- its parallel Linears return `(output, bias)`; `linear` hands back the output, as sglang's blocks
  read it (they drop the second item), and multiplies a batched input as diffusers' Linear does
  (see `linear`);
- its q/k norms are sglang's `RMSNorm` (weight, `variance_epsilon`), which computes PyTorch's RMSNorm;
  `rms_norm` vouches for one without a variance-size override, so the fused prologue computes it with
  diffusers' arithmetic (sglang's own GPU paths for this step do not: see docs/sglang.md);
- the attention is the module's `USPAttention` layer, so sglang's selected backend runs, handed the
  q, k, v its own attention forward would hand it.
The family's sglang binding (`models.flux2.sglang`) decides when a call runs on the block code at all
(one device, no sequence or tensor parallelism, unquantized, every module plain).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ...host import Attention, ModuleHost, RMSNormParameters, output_dropout_inactive, unwrapped

# PyTorch modules the block code computes itself where nothing wraps them.
TORCH_CLASSES = frozenset({nn.LayerNorm, nn.SiLU, nn.Dropout})


class SglangHost(ModuleHost):
    """The sglang host (see the module docstring): `classes` are the sglang (and diffusers) classes
    whose forward the block code reproduces, `rms_norm_class` sglang's RMSNorm, `foreign_calls`
    the classes `call` refuses (see there)."""

    def __init__(
        self, classes: frozenset[type], rms_norm_class: type, foreign_calls: frozenset[type]
    ) -> None:
        super().__init__(TORCH_CLASSES | classes | {rms_norm_class})
        self.rms_norm_class = rms_norm_class
        self.foreign_calls = foreign_calls

    def linear(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The module called on `x` laid out so that its rows fold into one matrix. diffusers'
        `nn.Linear` holds weights that require grad (as a loaded diffusers model's do, unless
        `requires_grad_(False)` was called on it), and for those aten's matmul folds a batched input
        into one matrix product, copying rows that are strided (the text or the image rows of a joint
        attention output at batch > 1); sglang's weights do not require grad, so on the same strided
        input its Linear would multiply batch by batch, with other bits. `reshape` then `view` give
        the same values in foldable strides (copying only where diffusers' fold copies), so sglang's
        Linear takes diffusers' product, and its hooks still see the [B, S, D] input. That holds for a
        projection without bias (every FLUX.2 projection) and for a biased one on rows that were
        foldable already; the binding runs no biased projection on strided rows
        (`models.flux2.sglang.runs_whole`)."""
        rows = x.reshape(-1, x.shape[-1]).view(x.shape) if x.dim() > 2 else x
        out = module(rows)
        return out[0] if isinstance(out, tuple) else out

    def float8_input(self, module: nn.Module) -> str | None:
        return None  # sglang's Linears quantize nothing the block code could hand them

    def rms_norm(self, module: nn.Module) -> RMSNormParameters | None:
        if (
            type(module) is not self.rms_norm_class
            or not self.plain(module)
            or getattr(module, "variance_size_override", None) is not None
        ):
            return None
        return RMSNormParameters(module.weight, module.variance_epsilon)

    def attention(
        self, attn: nn.Module, options: Mapping[str, Any] | None, text_tokens: int
    ) -> Attention | None:
        """sglang's attention layer of a plain attention module with separate q, k, v projections
        (no packed QKV, which its quantized checkpoints use) and an inactive output dropout; no
        per-call options (masks, sequence-parallel padding: sglang's own call handles those)."""
        core = getattr(attn, "attn", None)
        if (
            options
            or core is None
            or not self.plain(attn)
            or not unwrapped(core)
            or getattr(attn, "use_fused_qkv", False)
            or not output_dropout_inactive(self, attn)
        ):
            return None

        def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            # The text rows lead and are the same on every rank, as sglang's blocks declare them.
            out = core(query, key, value, num_replicated_prefix=text_tokens)
            return out.flatten(2, 3).to(query.dtype)

        return attend

    def call(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """A module's own call; refused for sglang's blocks and attention modules, which take other
        arguments than diffusers' (those the block code's fallbacks pass). The binding runs a call on
        the block code only where all of those are plain, so this never happens unless that check
        and the block code disagree, and then it fails loudly instead of computing something else."""
        if type(module) in self.foreign_calls:
            raise RuntimeError(
                f"flux2-fused: sglang's {type(module).__name__} called with diffusers' arguments"
            )
        return module(*args, **kwargs)

    def __repr__(self) -> str:
        return f"SglangHost({len(self.classes)} plain classes)"
