"""diffusers as a host: the fused path on diffusers' own modules, `enable(transformer or pipeline)`.

    from flux2_fused.integrations.diffusers import enable
    handle = enable(pipe)               # or enable(pipe.transformer); outputs stay bit-identical
    ...
    handle.disable()                    # diffusers' own forward again

`enable` finds the transformer's family in `registry.FAMILIES` (by class) and puts a forward in the
transformer's forward slot (`slots`, under whatever hooks wrap it) that runs the family's block code
on diffusers' own modules through a `DiffusersHost` (`host`). Nothing is copied or snapshotted:
every Linear is called as a module at call time, so LoRA layers (peft), quantized linears, weight
replacements, dtype and device moves act exactly as in diffusers.

Each call decides what it can vouch for, from the module state at that moment:
- attention through a processor the family maps (diffusers' default ones, KV-cache editing) runs
  the block code and hands q, k, v to diffusers' own `dispatch_attention_fn` with the processor's
  backend and parallel config: every attention backend, and context parallelism, stay fused;
- hooks that wrap the transformer's forward and end in the class's forward (accelerate's offload
  hook, diffusers' hook registry: context-parallel input splitting, caches) keep running around the
  fused forward, which takes the class forward's place at the bottom, whichever came first;
- a block (or its attention, feed-forward, output norm) that is not plain for the host (another
  processor or class, hooks, a wrapped or separately compiled forward) runs through diffusers' own
  call; the other blocks stay fused;
- the whole call takes diffusers' forward for what the family's forward does not implement, and
  for gradient checkpointing while a gradient is needed or a forward wrapper of unknown kind;
- everything the fused ops cannot prove exact (CPU, fp32, autograd, ...) declines inside them to
  the eager chain, as in the package's own model.
"""

from .host import Binding, DiffusersHost
from .patch import FusedHandle, enable
from .registry import FAMILIES
from .version import SUPPORTED_DIFFUSERS, check_version

__all__ = [
    "FAMILIES",
    "SUPPORTED_DIFFUSERS",
    "Binding",
    "DiffusersHost",
    "FusedHandle",
    "check_version",
    "enable",
]
