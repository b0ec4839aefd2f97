"""The ComfyUI node: "FLUX fused (bit-exact)" takes a MODEL and returns a clone of it patched.

ComfyUI finds it through `comfy_entrypoint` (its node API's entry point), in a one-line file in
`custom_nodes` (README, "ComfyUI"). The patch is an object patch on the clone (`patch.enable`), so
the MODEL given to the node, and every workflow without the node, runs ComfyUI's own forward; LoRA
loaders before or after the node, unloading and reloading keep it. A MODEL that is not ComfyUI's
FLUX passes through unchanged, with a warning.
"""

from __future__ import annotations

import warnings

from comfy_api.latest import ComfyExtension, io

from .patch import enable, is_comfy_flux


class FluxFused(io.ComfyNode):
    """The node: the MODEL's clone, with its FLUX transformer on the fused path where it is exact."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="FluxFused",
            display_name="FLUX fused (bit-exact)",
            category="advanced/model",
            description=(
                "Runs the FLUX.1 or FLUX.2 transformer through flux2-fused's fused kernels, bit-identical to "
                "ComfyUI's own output; any call it cannot run exactly runs ComfyUI's own code."
            ),
            inputs=[io.Model.Input("model")],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model: object) -> io.NodeOutput:
        patched = model.clone()
        if not is_comfy_flux(getattr(patched.model, "diffusion_model", None)):
            warnings.warn(
                "flux2-fused: the MODEL is not ComfyUI's FLUX model; it passes through unchanged",
                RuntimeWarning,
                stacklevel=2,
            )
            return io.NodeOutput(model)
        enable(patched)
        return io.NodeOutput(patched)


class Extension(ComfyExtension):
    """What ComfyUI's node loader asks this package for."""

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [FluxFused]


async def comfy_entrypoint() -> Extension:
    return Extension()
