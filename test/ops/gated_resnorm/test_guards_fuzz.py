"""Property-based fuzzing of the guards on CPU: 10,000 random calls of five guards, about a minute.

Tensors are drawn as specs (shape, layout, dtype, device, requires_grad) and built on CPU, on the
meta device, or as CUDA stand-ins over meta tensors (conftest.as_cuda), which reach every check
after the device check without allocating anything. The self-check needs a GPU, so the runtime
stage accepts (conftest.accept_runtime): whatever a guard declines here, the metadata checks did.

Properties: the public guards never raise and return a bool that agrees with their reason function
(which never raises either); the validated ops raise TypeError or ValueError carrying that reason; no
guard accepts inputs the kernel cannot reproduce (`reproduces_eager`, stated from eager's
broadcasting and the kernel's memory reads, not from the guard's code); and FLUX.2's and FLUX.3's
own layouts (modulation rows per batch, broadcast or per token; one update or two) are always
accepted.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from flux2_fused.ops.gated_resnorm import MAX_DIM, ROW_MOD_MAX_DIM

from ..conftest import as_cuda, misaligned
from .conftest import GUARDS, check_guard

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SUPPORTED = (torch.bfloat16, torch.float16)

SIZES = st.sampled_from([0, 1, 2, 3, 5])
DIMS = st.sampled_from([4, 8, 12, 16, MAX_DIM, 0, 1, 3, 6, MAX_DIM + 4])
DTYPES = st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.int32])
DEVICES = st.sampled_from(["cuda:0", "cuda:1", "cpu", "meta"])
GARBAGE = st.sampled_from([None, 0, 1.5, "residual", (1, 2), b"bytes"])
# How a tensor's memory is laid out under its logical shape (see `build`).
LAYOUTS = [
    "contiguous",
    "transposed",
    "batch-major",
    "step",
    "offset",
    "row-offset",
    "expand",
    "chunk",
    "odd-batch",
]
# One thing changed in an argument of a FLUX.2 or FLUX.3 layout (see `flux_sites`).
CHANGES = ["shape", "layout", "dtype", "device", "grad", "garbage"]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor to build: its logical shape and how its memory sits under it."""

    shape: tuple[int, ...]
    layout: str = "contiguous"
    dtype: torch.dtype = torch.bfloat16
    device: str = "cuda:0"
    requires_grad: bool = False
    k: int = 1  # the chunk index, or the rows skipped by "row-offset"


def build(spec: Any) -> Any:
    """The tensor a spec describes (anything else is returned as the garbage it is).

    Layouts that need more axes than the shape has fall back to contiguous.
    """
    if not isinstance(spec, TensorSpec):
        return spec
    base = "cpu" if spec.device == "cpu" else "meta"
    shape, k, rank = spec.shape, spec.k, len(spec.shape)

    def empty(*sizes: int) -> torch.Tensor:
        return torch.empty(sizes, dtype=spec.dtype, device=base)

    match spec.layout:
        case "transposed" if rank >= 2:  # inner stride != 1
            t = empty(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)
        case "batch-major" if rank == 3:  # [T, B, D] memory seen as [B, T, D]
            t = empty(shape[1], shape[0], shape[2]).transpose(0, 1)
        case "step" if rank >= 1:
            t = empty(*shape[:-1], 2 * shape[-1])[..., ::2]
        case "offset":  # data pointer one element past alignment
            t = misaligned(*shape, dtype=spec.dtype, device=base)
        case "row-offset" if rank >= 2:  # the last rows of a longer stream
            t = empty(*shape[:-2], shape[-2] + k, shape[-1])[..., k:, :]
        case "expand" if rank >= 1:  # batch stride 0
            t = empty(1, *shape[1:]).expand(shape)
        case "chunk" if rank >= 1:  # FLUX.2's modulation chunk views
            t = empty(*shape[:-1], 6 * shape[-1]).narrow(-1, k * shape[-1], shape[-1])
        case "odd-batch" if rank >= 2:  # batch stride 2 elements past dense
            inner = math.prod(shape[1:])
            strides = empty(*shape[1:]).stride()
            t = empty(shape[0] * (inner + 2)).as_strided(shape, (inner + 2, *strides))
        case _:
            t = empty(*shape)
    if spec.requires_grad:
        t.requires_grad_()
    return as_cuda(t, int(spec.device[5:])) if spec.device.startswith("cuda") else t


@st.composite
def shapes(draw: st.DrawFn) -> tuple[int, ...]:
    """Rank 0 to 4: small sizes (0 and 1 included), then a hidden size."""
    rank = draw(st.integers(0, 4))
    if rank == 0:
        return ()
    return (*draw(st.lists(SIZES, min_size=rank - 1, max_size=rank - 1)), draw(DIMS))


@st.composite
def tensor_specs(draw: st.DrawFn) -> TensorSpec:
    """Any tensor: any shape, layout, dtype, device and grad flag."""
    dtype = draw(DTYPES)
    return TensorSpec(
        shape=draw(shapes()),
        layout=draw(st.sampled_from(LAYOUTS)),
        dtype=dtype,
        device=draw(DEVICES),
        requires_grad=dtype.is_floating_point and draw(st.booleans()),
        k=draw(st.integers(0, 5)),
    )


SITE = ("residual", "update", "update2", "gate", "scale", "shift")  # what a draw holds, in this order
STREAMS = ("residual", "x", "update", "update2")


def positions(kind: str) -> list[int]:
    """Where a guard's arguments sit in a drawn site (the modnorm guard's x is the residual)."""
    return [SITE.index("residual" if name == "x" else name) for name in GUARDS[kind].names]


@settings(FUZZ, max_examples=4000)
@given(args=st.tuples(*[st.one_of(GARBAGE, tensor_specs()) for _ in SITE]), grad_mode=st.booleans())
@pytest.mark.usefixtures("accept_runtime")
def test_random_arguments(args: tuple[Any, ...], grad_mode: bool) -> None:
    """Six independent random arguments: rarely acceptable, always answered."""
    tensors = tuple(build(spec) for spec in args)
    with torch.set_grad_enabled(grad_mode):
        for kind in GUARDS:
            check_guard(kind, tuple(tensors[i] for i in positions(kind)))


def row_pointers(t: torch.Tensor) -> list[int]:
    """The address of every row (last axis) of `t`."""
    return [
        t.data_ptr() + t.element_size() * sum(i * s for i, s in zip(index, t.stride(), strict=False))
        for index in itertools.product(*(range(n) for n in t.shape[:-1]))
    ]


def reproduces_eager(streams: list[Any], mods: list[Any]) -> bool:
    """What the kernel needs to compute exactly what eager computes (the guards may decline more).

    Eager: stream shapes equal (else it would broadcast them), one CUDA device, one bf16/fp16 dtype
    (else it would promote), no autograd graph wanted, and modulation rows that leave the stream's
    shape as it is - padded to 3-D as eager aligns trailing axes, [R, S, D] with R one or the batch
    and S one (broadcast over tokens) or the tokens (one row a token).
    aten's vectorized LayerNorm and the kernel: 0 < D <= MAX_DIM, D % 4 == 0, and D up to
    ROW_MOD_MAX_DIM where a modulation has a row a token (the instantiations built). The kernel's
    reads: every row has unit stride and starts 8-byte aligned.
    """
    tensors = streams + mods
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    first = streams[0]
    if first.dim() not in (2, 3) or any(s.shape != first.shape for s in streams):
        return False
    if first.device.type != "cuda" or any(t.device != first.device for t in tensors):
        return False
    if first.dtype not in SUPPORTED or any(t.dtype != first.dtype for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    dim, batch = first.shape[-1], first.shape[0] if first.dim() == 3 else 1
    tokens = first.shape[-2]
    if not (0 < dim <= MAX_DIM and dim % 4 == 0):
        return False
    for m in mods:
        if not 1 <= m.dim() <= 3:
            return False
        rows, per_token, channels = (1,) * (3 - m.dim()) + tuple(m.shape)
        if per_token not in (1, tokens) or channels != dim or rows not in (1, batch):
            return False
        if per_token > 1 and dim > ROW_MOD_MAX_DIM:
            return False
    return all(t.stride(-1) == 1 and all(p % 8 == 0 for p in row_pointers(t)) for t in tensors)


@st.composite
def flux_sites(draw: st.DrawFn) -> tuple[tuple[Any, ...], bool]:
    """(residual, update, update2, gate, scale, shift) near FLUX.2's and FLUX.3's layouts, and
    whether they are exactly one.

    Each argument is one of those layouts for the drawn (B, T, D), dtype and device (modulation rows
    per batch, broadcast, or per token: chunks of a [B, T, 6D] tensor, [T, D], [1, T, D], expanded
    over the batch); up to two of them get one thing changed: shape, layout, dtype, device, grad
    flag, or garbage instead. The draws lean towards what the kernel supports, so that about a fifth
    of the calls are accepted.
    """
    batch, tokens, dim = draw(SIZES), draw(SIZES), draw(DIMS)
    rank = draw(st.sampled_from([2, 3]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.bfloat16, torch.float16, torch.float32]))
    device = draw(st.sampled_from(["cuda:0", "cuda:0", "cuda:0", "cuda:1", "cpu", "meta"]))
    changed = draw(st.sets(st.integers(0, len(SITE) - 1), max_size=2))
    stream_shape = (batch, tokens, dim) if rank == 3 else (tokens, dim)
    rows = batch if rank == 3 else 1
    stream_layouts = [("contiguous", stream_shape), ("row-offset", stream_shape)]
    if rank == 3:
        stream_layouts.append(("expand", stream_shape))  # one stream shared by the batch: batch stride 0
    mod_layouts = [("contiguous", s) for s in ((dim,), (1, dim), (1, 1, dim), (rows, 1, dim))]
    mod_layouts += [("chunk", (rows, 1, dim)), ("expand", (rows, 1, dim))]
    # Per token (FLUX.3): one row a token, per batch or shared by the batch.
    mod_layouts += [("contiguous", s) for s in ((tokens, dim), (1, tokens, dim), (rows, tokens, dim))]
    mod_layouts += [("chunk", (rows, tokens, dim)), ("expand", (rows, tokens, dim))]
    canonical = dtype in SUPPORTED and device.startswith("cuda") and 0 < dim <= MAX_DIM and dim % 4 == 0
    args = []
    for position, name in enumerate(SITE):
        layout, shape = draw(st.sampled_from(stream_layouts if name in STREAMS else mod_layouts))
        spec = TensorSpec(shape, layout, dtype, device, k=draw(st.integers(0, 5)))
        change = draw(st.sampled_from(CHANGES)) if position in changed else None
        if change == "shape":
            spec = dataclasses.replace(spec, shape=draw(shapes()))
        elif change == "layout":
            spec = dataclasses.replace(spec, layout=draw(st.sampled_from(LAYOUTS)))
        elif change == "dtype":
            spec = dataclasses.replace(spec, dtype=draw(DTYPES))
        elif change == "device":
            spec = dataclasses.replace(spec, device=draw(DEVICES))
        elif change == "grad":
            spec = dataclasses.replace(spec, requires_grad=True)
        elif change == "garbage":
            spec = draw(GARBAGE)
        per_token = name not in STREAMS and len(shape) >= 2 and shape[-2] == tokens > 1
        canonical = canonical and change is None and not (per_token and dim > ROW_MOD_MAX_DIM)
        args.append(spec)
    return tuple(args), canonical


@settings(FUZZ, max_examples=6000)
@given(site=flux_sites(), grad_mode=st.booleans())
@pytest.mark.usefixtures("accept_runtime")
def test_flux_like_arguments(site: tuple[tuple[Any, ...], bool], grad_mode: bool) -> None:
    specs, canonical = site
    tensors = tuple(build(spec) for spec in specs)
    with torch.set_grad_enabled(grad_mode):
        for kind in GUARDS:
            args = [tensors[i] for i in positions(kind)]
            names = GUARDS[kind].names
            streams = [t for name, t in zip(names, args, strict=True) if name in STREAMS]
            mods = [t for name, t in zip(names, args, strict=True) if name not in STREAMS]
            reason = check_guard(kind, tuple(args))
            event(f"{kind}: {'accepted' if reason is None else 'declined'}")  # --hypothesis-show-statistics
            if reason is None:
                assert reproduces_eager(streams, mods), f"{kind} accepted what the kernel cannot reproduce"
            if canonical:
                assert reason is None, f"{kind} declined FLUX.2's or FLUX.3's own layout: {reason}"
