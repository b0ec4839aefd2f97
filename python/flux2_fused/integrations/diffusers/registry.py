"""Which family runs a diffusers model: one line per transformer class.

A model is looked up by its class, not its name (another library's FLUX.2 transformer is also called
`Flux2Transformer2DModel`): the fully qualified names along its class's MRO, so a subclass of a
registered class is found too. A family's binding module is imported only when a model of it is
enabled. Adding a family is one line here plus the family's folder, whose `diffusers` module exports
`BINDING` (`host.Binding`).
"""

from __future__ import annotations

import importlib

from torch import nn

from ...host import class_named
from .host import Binding

# transformer class (module.qualname) -> the module of its family that exports BINDING
FAMILIES = {
    "diffusers.models.transformers.transformer_flux2.Flux2Transformer2DModel": (
        "flux2_fused.models.flux2.diffusers"
    ),
    "diffusers.models.transformers.transformer_flux.FluxTransformer2DModel": (
        "flux2_fused.models.flux1.diffusers"
    ),
    "diffusers.models.transformers.transformer_flux3.Flux3Transformer2DModel": (
        "flux2_fused.models.flux3.diffusers"
    ),
    "diffusers.models.transformers.transformer_qwenimage.QwenImageTransformer2DModel": (
        "flux2_fused.models.qwenimage.diffusers"
    ),
    "diffusers.models.transformers.transformer_z_image.ZImageTransformer2DModel": (
        "flux2_fused.models.zimage.diffusers"
    ),
}


def binding_for(model: nn.Module) -> Binding | None:
    """The binding of the family `model`'s class belongs to, None where no family covers it."""
    name = class_named(type(model), FAMILIES)
    return None if name is None else importlib.import_module(FAMILIES[name]).BINDING
