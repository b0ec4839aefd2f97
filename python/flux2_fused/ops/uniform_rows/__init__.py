"""uniform_rows: a proof, on the device, that every row of a tensor equals its batch's first row.

FLUX.3's per-token modulation is a Linear of a time embedding expanded over the tokens, so its
[B, S, 3D] rows are computed from identical inputs; every mode block reads three of them a token.
`check(x)` launches one kernel that compares every row with its batch's first, bit for bit, and
returns a `UniformRows` holding the kernel's word (0: all equal, 1: some row differs). The word
stays on the GPU: `gated_resnorm` reads it inside its kernel and, where it is 0, reads each batch's
first row for every token, from cache, in place of the token's own row, the same bytes. Where the
word is 1 it reads the token's row as before; nothing waits for the answer on the host.

A proof covers views of the tensor it checked (`UniformRows.word`): column chunks and token ranges
of its rows, while the tensor is unchanged (its version counter, where torch keeps one) and not
revoked (`revoke`: the block code revokes a proof when it hands the tensor to code it does not own,
which could change it in place under inference mode, where torch keeps no version counter).
`uniform_rows` is the validated op that returns the word and raises for inputs it cannot take.
"""

from __future__ import annotations

import torch

from ..verdicts import raise_for
from . import guards, reference
from .guards import SUPPORTED_DTYPES, decline_reason
from .launch import KERNEL, launch
from .selfcheck import OP, Config, self_check


def _storage_start(t: torch.Tensor) -> int:
    """The address of t's storage (views of one storage share it; inference mode tracks no `_base`)."""
    return t.data_ptr() - t.storage_offset() * t.element_size()


class UniformRows:
    """The kernel's word for `source` ([B, S, W] contiguous), and which views it speaks for."""

    __slots__ = ("differs", "revoked", "source", "start", "version")

    def __init__(self, source: torch.Tensor, differs: torch.Tensor) -> None:
        self.source = source  # held: its memory cannot be reused for another tensor while proven
        self.start = _storage_start(source)
        self.differs = differs
        # Inference tensors keep no version counter: revocation alone guards them.
        self.version = None if source.is_inference() else source._version
        self.revoked = False

    def revoke(self) -> None:
        """Stop vouching for the source: it went where it might be changed in place."""
        self.revoked = True

    def word(self, *views: torch.Tensor) -> torch.Tensor | None:
        """The word where every view is rows and columns of the source, unchanged since the check;
        None otherwise (the kernel then reads every token's own row)."""
        if self.revoked:
            return None
        try:
            return self.differs if all(self._covers(view) for view in views) else None
        except Exception:  # whatever a view is, a question about it never fails a generation
            return None

    def _covers(self, view: torch.Tensor) -> bool:
        source = self.source
        if not isinstance(view, torch.Tensor) or view.dtype != source.dtype or view.device != source.device:
            return False
        if _storage_start(view) != self.start:
            return False
        if view.dim() != source.dim() or view.stride() != source.stride():
            return False
        if view.shape[:-2] != source.shape[:-2]:
            return False
        if self.version is not None and view._version != self.version:
            return False
        if source.stride(-2) <= 0:  # one row a batch (a contiguous [B, 1, W] may have any row stride)
            return False
        first_row, column = divmod(view.storage_offset() - source.storage_offset(), source.stride(-2))
        rows, width = source.shape[-2:]
        # With the source's strides and batches, the view is rows [first_row, first_row + S') and
        # columns [column, column + W') of each of the source's batches.
        return first_row >= 0 and first_row + view.shape[-2] <= rows and column + view.shape[-1] <= width


def check(x: torch.Tensor, *, enabled: bool = True) -> UniformRows | None:
    """A proof for x from one launch, or None where the kernel declines (CPU tensors, other dtypes
    and layouts, the kill switch, a failed self-check), under a torch.compile trace, or with
    `enabled=False` (a model's switch)."""
    if not enabled or torch.compiler.is_compiling() or not guards.check(x):
        return None
    return UniformRows(x, launch(x))


def uniform_rows(x: torch.Tensor) -> torch.Tensor:
    """The kernel's word for x (int32 [1]: 1 where a row differs from its batch's first), without the
    self-check. Unsupported inputs raise TypeError (types, dtypes, devices) or ValueError (shapes,
    layouts)."""
    raise_for(guards.check.input_reason(x))
    return launch(x)


__all__ = [
    "KERNEL",
    "OP",
    "SUPPORTED_DTYPES",
    "Config",
    "UniformRows",
    "check",
    "decline_reason",
    "guards",
    "reference",
    "self_check",
    "uniform_rows",
]
