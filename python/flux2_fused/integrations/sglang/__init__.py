"""sglang as a host: sglang's FLUX.2 DiT on the family's block code and the fused ops.

Installed next to sglang, the package is a diffusion plugin of sglang's runtime (`plugin`): every FLUX.2
DiT sglang builds runs fused, with no flag. For a DiT built by hand:

    from flux2_fused.integrations.sglang import enable
    handle = enable(dit)                # sglang's Flux2Transformer2DModel
    ...
    handle.disable()                    # sglang's own forward again

A call runs on the block code (through an `SglangHost`, `host`) where the family's sglang binding
(`flux2_fused.models.flux2.sglang`) can do all of it, and is then bit-identical to diffusers' eager
forward with the same weights; elsewhere (tensor or sequence parallelism, sglang's quantized
checkpoints, a wrapped module, attention masks) it is sglang's own forward. docs/sglang.md has the
details.
"""

from .host import SglangHost
from .patch import FusedHandle, enable, is_sglang_dit

__all__ = ["FusedHandle", "SglangHost", "enable", "is_sglang_dit"]
