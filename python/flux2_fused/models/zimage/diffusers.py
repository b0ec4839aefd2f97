"""Z-Image as diffusers writes it: the binding of `ZImageTransformer2DModel` to the block code.

The diffusers host finds this module through its registry. The transformer's own forward runs
(patchify, the embedders, the unified sequence, the final layer, unpatchify); each
`ZImageTransformerBlock` it calls (the noise and caption refiners, the main layers) runs on the
block code (`blocks.block_call`), under whatever wraps it (hooks, caches, offload), and its
attention is diffusers' `dispatch_attention_fn` with the processor's backend and parallel config
under the padding mask, as `ZSingleStreamAttnProcessor` calls it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from ...host import Attention
from ...integrations.diffusers.host import Binding, DiffusersHost
from ..deferral import Fusion
from .blocks import MASK, MODULE, block_call


def _attention(
    host: DiffusersHost, processor: Any, options: Mapping[str, Any], text_tokens: int
) -> Attention | None:
    """`ZSingleStreamAttnProcessor`'s attention: diffusers' `dispatch_attention_fn` with the
    processor's backend and parallel config under the padding mask ([B, S] widened to [B, 1, 1, S]
    as the processor widens it), flattened and cast to q's dtype. Other arguments: the module's own
    call."""
    if not set(options) <= {MASK}:
        return None
    mask = options.get(MASK)
    if mask is None:
        return host.dispatch(processor)
    if mask.ndim == 2:
        mask = mask[:, None, None, :]
    return host.dispatch(processor, lambda query: mask)


def forward(model: nn.Module, host: DiffusersHost, fusion: Fusion, args: tuple, kwargs: dict) -> None:
    """diffusers' own forward runs every call: its blocks run on the block code where they are called."""
    return None


BINDING = Binding(
    classes=(
        f"{MODULE}.ZImageTransformerBlock",
        f"{MODULE}.FeedForward",
        "diffusers.models.attention_processor.Attention",
        "diffusers.models.normalization.RMSNorm",  # the q/k norms
    ),
    processors={f"{MODULE}.ZSingleStreamAttnProcessor": _attention},
    forward=forward,
    blocks={f"{MODULE}.ZImageTransformerBlock": block_call},
)
