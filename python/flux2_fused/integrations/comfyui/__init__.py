"""ComfyUI as a host: ComfyUI's FLUX model (FLUX.1 and FLUX.2) on the block code and the fused ops.

In a workflow, the "FLUX fused (bit-exact)" node (`nodes`) takes a MODEL and returns it patched. In
Python:

    from flux2_fused.integrations.comfyui import enable
    handle = enable(model)              # a ModelPatcher, a BaseModel or comfy.ldm.flux.model.Flux
    ...
    handle.disable()                    # ComfyUI's own forward again

A call runs on the block code (through a `ComfyHost`, `host`) where the family's ComfyUI binding
(`flux2_fused.models.flux2.comfyui`) can do all of it, and is then bit-identical to ComfyUI's own
output; elsewhere (other FLUX variants, ControlNet, block replacements, attention patches) it is
ComfyUI's own forward. docs/comfyui.md has the details.
"""

from .host import ComfyHost, View
from .patch import FusedHandle, enable, is_comfy_flux

__all__ = ["ComfyHost", "FusedHandle", "View", "enable", "is_comfy_flux"]
