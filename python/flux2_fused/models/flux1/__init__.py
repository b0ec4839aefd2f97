"""The FLUX.1 family: FLUX.1 dev and schnell, and the Fill, Kontext and ControlNet pipelines around
the same transformer.

`config` holds the sizes (as diffusers' constructor arguments) and the pipelines' position ids,
`blocks` the block code, and `diffusers` how diffusers' `FluxTransformer2DModel` maps onto it; the
diffusers host finds that module through its registry. The family reuses FLUX.2's fused sites (the
gated residual + LayerNorm + adaLN, the QK RMSNorm + RoPE prologue) and adds the tanh GELU.
"""

from .config import FLUX1_PRESETS, flux1_config, image_ids, text_ids

__all__ = ["FLUX1_PRESETS", "flux1_config", "image_ids", "text_ids"]
