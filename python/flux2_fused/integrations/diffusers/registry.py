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

from .host import Binding

# transformer class (module.qualname) -> the module of its family that exports BINDING
FAMILIES = {
    "diffusers.models.transformers.transformer_flux2.Flux2Transformer2DModel": (
        "flux2_fused.models.flux2.diffusers"
    ),
    "diffusers.models.transformers.transformer_flux.FluxTransformer2DModel": (
        "flux2_fused.models.flux1.diffusers"
    ),
}


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def binding_for(model: nn.Module) -> Binding | None:
    """The binding of the family `model`'s class belongs to, None where no family covers it."""
    for cls in type(model).__mro__:
        module = FAMILIES.get(qualified_name(cls))
        if module is not None:
            return importlib.import_module(module).BINDING
    return None
