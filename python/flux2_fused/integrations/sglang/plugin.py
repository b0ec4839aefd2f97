"""The sglang diffusion plugin: installing flux2-fused is the whole activation.

sglang's diffusion runtime (0.5.x) runs, in every worker and in its offline generator, the callables
registered under the entry-point group `sglang.multimodal_gen.plugins` (the package declares
`flux2_fused = "flux2_fused.integrations.sglang.plugin:register"`), then applies the hooks they
registered. `register` adds one AROUND hook on sglang's `Flux2Transformer2DModel.forward`: every
FLUX.2 DiT the runtime builds then runs `patch.fused_call`, fused where proven exact and sglang's own
forward elsewhere. sglang's `SGLANG_PLUGINS` (a comma-separated allow list of plugin names) turns it
off without uninstalling; `FLUX2_FUSED_DISABLE=1` turns every fused site off.
"""

from __future__ import annotations

from .patch import TRANSFORMER, fused_call


def register() -> None:
    """Register the forward hook with sglang's diffusion hook registry."""
    from sglang.multimodal_gen.runtime.platforms.plugins import HookType, plugin_hook

    plugin_hook(f"{TRANSFORMER}.forward", HookType.AROUND)(fused_call)
