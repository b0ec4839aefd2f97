"""The FLUX.3 family: FLUX.3 [klein] and its step-distilled (flow-map) form, text-to-image and
image-to-image with reference images.

`config` holds the sizes (as diffusers' constructor arguments) and the pipelines' position ids,
`blocks` the block code, and `diffusers` how diffusers' `Flux3Transformer2DModel` maps onto it; the
diffusers host finds that module through its registry. The family grows FLUX.2's fused sites: the
modulated norm and gated residual take per-token modulation and a two-term update, the single
block's twin norms write one joint buffer, and the QK prologue runs in fp32.
"""

from .config import FLUX3_PRESETS, flux3_config, image_ids, text_ids

__all__ = ["FLUX3_PRESETS", "flux3_config", "image_ids", "text_ids"]
