"""The FLUX.2 family: FLUX.2 dev, klein 4B and klein 9B.

`config` holds the architecture and the pipelines' position ids, `blocks` the block code every host
runs, `model` the package's own eager model, and `diffusers` how diffusers' FLUX.2 transformer maps
onto the block code (its forward's arguments, processors and classes), which the diffusers host
finds through its registry.
"""

from .config import Flux2Config, image_ids, text_ids
from .model import HOST, Flux2Transformer, timestep_sinusoid

__all__ = ["HOST", "Flux2Config", "Flux2Transformer", "image_ids", "text_ids", "timestep_sinusoid"]
