"""The guard machinery every fused op shares: decline reasons, remembered verdicts, validation.

A guard answers "does the kernel reproduce eager for these arguments?" and never raises: a guard
must never be the reason a generation fails. Its answer has three parts:
- metadata: what shapes, strides, dtypes and devices decide. Tensors with equal metadata get the
  same answer, so it is remembered (a bounded memo): at every fused site the guard then costs a
  key and a dict lookup instead of the full checks.
- per call: what equal metadata does not decide, namely tensor subclasses (a kernel reads only
  plain tensors' memory), autograd (the kernels have no backward) and data alignment (aten's
  vectorized kernels, and ours, move 8 bytes at a time).
- runtime: the kill switch, the kernel build and the live self-check (`runtime.py`).
The `reason` form runs every check without the memo and says why in words; the validated public
ops raise TypeError for a `TypeReason` (types, dtypes, devices) and ValueError for the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

ALIGN = 8  # bytes: aten's vectorized paths (and most of our kernels) move 4 x 16-bit elements at a time

Reason = str | None


class TypeReason(str):
    """A decline reason about types (not a tensor, dtype, device); validation raises TypeError for it."""


def raise_for(reason: Reason) -> None:
    """Raise the error a validated op gives for a decline reason (nothing for None)."""
    if reason is not None:
        raise (TypeError if isinstance(reason, TypeReason) else ValueError)(f"flux2-fused: {reason}")


# The kernels read memory at data_ptr(), which is a tensor's values only for these types. A tensor
# subclass may keep them elsewhere: an AsyncCollectiveTensor (tensor parallelism's all-reduced
# output before its wait) reports data_ptr 0, and a kernel handed one read address 0; a DTensor
# holds only its local shard; what other subclasses' operators mean is theirs to say. So every
# subclass declines.
PLAIN_TYPES: tuple[type, ...] = (torch.Tensor, torch.nn.Parameter)


def call_reason(names: Sequence[str], tensors: Sequence[torch.Tensor], align: int = ALIGN) -> Reason:
    """The checks that tensors with equal metadata can still fail: tensor subclasses, autograd and
    data alignment."""
    grad = torch.is_grad_enabled()
    for name, t in zip(names, tensors, strict=True):
        reason = tensor_call_reason(name, t, grad, align)
        if reason is not None:
            return reason
    return None


def tensor_call_reason(name: str, t: torch.Tensor, grad: bool, align: int) -> Reason:
    """`call_reason`'s checks of one tensor, `grad` whether autograd is on."""
    if type(t) not in PLAIN_TYPES:
        return TypeReason(f"{name} is a {type(t).__name__}; the kernel reads plain tensors only")
    if grad and t.requires_grad:
        return f"{name} requires grad and the fused kernel has no backward"
    if t.data_ptr() % align != 0:
        return f"{name} data pointer is not {align}-byte aligned"
    return None


# Bounded: cleared when it grows past this many verdicts (a model has a few dozen distinct sites).
MAX_VERDICTS = 4096
_verdicts: dict[tuple, bool] = {}


class Guard:
    """One op's guard over positional tensor arguments named `names`.

    metadata(*args) -> reason covers everything the arguments' metadata decides; runtime(*args) ->
    reason asks the process state (kill switch, self-check) once the inputs are acceptable; align is
    the data-pointer alignment (bytes) the kernel's vector accesses need.
    """

    def __init__(
        self,
        names: tuple[str, ...],
        metadata: Callable[..., Reason],
        runtime: Callable[..., Reason],
        align: int = ALIGN,
    ) -> None:
        self.names = names
        self.metadata = metadata
        self.runtime = runtime
        self.align = align

    def input_reason(self, *args: Any) -> Reason:
        """Why the kernel cannot take these arguments, before any runtime state is asked."""
        return self.metadata(*args) or call_reason(self.names, args, self.align)

    def reason(self, *args: Any) -> Reason:
        """Why the guard declines these arguments (every check, no memo), or None when it accepts."""
        return self.input_reason(*args) or self.runtime(*args)

    def validate(self, *args: Any) -> None:
        """Raise TypeError / ValueError naming what the kernel cannot take (runtime state aside)."""
        raise_for(self.input_reason(*args))

    def __call__(self, *args: Any) -> bool:
        """`reason(*args) is None`, with the metadata verdict remembered. Never raises.

        One pass over the arguments makes the memo's key and runs `call_reason`'s checks (a pipelined
        step asks a few hundred guards, and the host's time per step can set its pace)."""
        try:
            grad = torch.is_grad_enabled()
            key: list[Any] = [self]
            for name, t in zip(self.names, args, strict=True):
                if tensor_call_reason(name, t, grad, self.align) is not None:
                    return False
                key.append((t.shape, t.stride(), t.dtype, t.device))
            memo = tuple(key)
            accepted = _verdicts.get(memo)
            if accepted is None:
                accepted = self.metadata(*args) is None
                if len(_verdicts) >= MAX_VERDICTS:
                    _verdicts.clear()
                _verdicts[memo] = accepted
            return accepted and self.runtime(*args) is None
        except Exception:  # a guard must never be the reason a generation fails
            return False
