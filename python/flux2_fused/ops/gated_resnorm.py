"""Guards, raw ops, eager references and the live self-check around the fused CUDA kernel.

The fused path computes, for each row, `residual_out = residual + gate * update` and
`out = (1 + scale) * layer_norm(residual_out) + shift` bit for bit as PyTorch eager does. It is only
ever taken where it is proven exact: the guards decline (never raise) for anything the kernel cannot
reproduce, and before the first fused call for a (D, dtype, device, torch version) the kernel is
compared with live eager on fresh random and edge rows; a single differing bit disables that
configuration for the rest of the process. Callers then run the eager chain, with identical results.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import jit

DISABLE_ENV = "FLUX2_FUSED_DISABLE"
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
MAX_DIM = 16384  # the kernel's largest instantiation: 32 vectors of 4 per thread, 128 threads
_ALIGN = 8  # bytes: the kernel and aten's vectorized LayerNorm move 4 elements at a time

_FLAG_GATED, _FLAG_RESIDUAL_OUT, _FLAG_TWO_SEGMENTS = 1, 2, 4


# --------------------------------------------------------------------------- eager references


def gated_resnorm_reference(
    residual: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager chain the kernel replaces, op for op as FLUX.2 (diffusers) writes it."""
    residual_out = residual + gate * update
    return modnorm_reference(residual_out, scale, shift, eps), residual_out


def modnorm_reference(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """`(1 + scale) * layer_norm(x) + shift`, LayerNorm without affine, as eager computes it."""
    return (1 + scale) * F.layer_norm(x, (x.shape[-1],), eps=eps) + shift


# --------------------------------------------------------------------------- guards


class TypeReason(str):
    """A decline reason about types (not a tensor, dtype, device); the raw ops raise TypeError for it."""


def enabled() -> bool:
    """False when the environment switch FLUX2_FUSED_DISABLE is set to a true value."""
    value = os.environ.get(DISABLE_ENV)
    return value is None or value.strip().lower() not in ("1", "true", "yes", "on")


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % _ALIGN == 0


def _stream_reason(name: str, t: Any, like: torch.Tensor | None) -> str | None:
    """Why a [B, T, D] / [T, D] stream tensor (residual or update) cannot go to the kernel."""
    if not isinstance(t, torch.Tensor):
        return TypeReason(f"{name} is not a tensor")
    if t.dim() not in (2, 3):
        return f"{name} must be [B, T, D] or [T, D], got {tuple(t.shape)}"
    if like is not None and t.shape != like.shape:
        return f"{name} shape {tuple(t.shape)} differs from residual {tuple(like.shape)}"
    # Rows must be dense; a batch stride is free (the output norm reads image rows of the joint stream).
    if t.stride(-1) != 1 or (t.shape[-2] > 1 and t.stride(-2) != t.shape[-1]):
        return f"{name} is not contiguous along its rows (needs strides (..., D, 1))"
    if t.dim() == 3 and t.shape[0] > 1 and t.stride(0) % 4 != 0:
        return f"{name} batch stride {t.stride(0)} is not a multiple of 4 elements"
    return None


def _modulation_reason(name: str, t: Any, batch: int, dim: int) -> str | None:
    """Modulation rows broadcast over tokens: [D], [1, D] or [1|B, 1, D] with unit inner stride."""
    if not isinstance(t, torch.Tensor):
        return TypeReason(f"{name} is not a tensor")
    shape = tuple(t.shape)
    if t.dim() == 1:
        rows = 1
    elif t.dim() == 2:
        # Eager aligns [R, D] with the stream's last two axes, i.e. with tokens: only [1, D] broadcasts
        # over them; per-batch rows must be [B, 1, D].
        if shape[0] != 1:
            return f"{name} must broadcast over tokens: a 2-D {name} is [1, D], got {shape} (use [B, 1, D])"
        rows = 1
    elif t.dim() == 3 and shape[1] == 1:
        rows = shape[0]
    else:
        return f"{name} must broadcast over tokens ([D], [1, D] or [B, 1, D]), got {shape}"
    if shape[-1] != dim:
        return f"{name} has {shape[-1]} channels, residual has {dim}"
    if rows not in (1, batch):
        return f"{name} batch {shape[0]} does not match the stream batch {batch}"
    if t.stride(-1) != 1:
        return f"{name} has inner stride {t.stride(-1)} (needs 1)"
    if t.dim() >= 2 and rows > 1 and t.stride(0) % 4 != 0:
        return f"{name} batch stride {t.stride(0)} is not a multiple of 4 elements"
    return None


def _common_reason(tensors: Sequence[tuple[str, torch.Tensor]]) -> str | None:
    """Device, dtype and hidden-size checks shared by every guard."""
    first = tensors[0][1]
    if first.device.type != "cuda":
        return TypeReason(f"tensors are on {first.device}, the fused kernel needs CUDA")
    if first.dtype not in SUPPORTED_DTYPES:
        return TypeReason(f"dtype {first.dtype} is not supported (bfloat16, float16)")
    for name, t in tensors:
        if t.device != first.device:
            return TypeReason(f"{name} is on {t.device}, {tensors[0][0]} on {first.device}")
        if t.dtype != first.dtype:
            return TypeReason(f"{name} is {t.dtype}, {tensors[0][0]} is {first.dtype} (eager would promote)")
    dim = first.shape[-1]
    if dim <= 0 or dim % 4 != 0:
        return f"hidden size {dim} is not a positive multiple of 4 (aten would not vectorize)"
    if dim > MAX_DIM:
        return f"hidden size {dim} exceeds the kernel's maximum {MAX_DIM}"
    return None


def _call_reason(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> str | None:
    """The checks that tensors with equal metadata can still fail: autograd and data alignment."""
    grad = torch.is_grad_enabled()
    for name, t in zip(names, tensors, strict=True):
        if grad and t.requires_grad:
            return f"{name} requires grad and the fused kernel has no backward"
        if not _aligned(t):
            return f"{name} data pointer is not {_ALIGN}-byte aligned"
    return None


def _stream_batch(t: torch.Tensor) -> int:
    return t.shape[0] if t.dim() == 3 else 1


def _metadata_reason(
    residual: Any, update: Any, modulation: Sequence[tuple[str, Any]], *, gated: bool = True
) -> str | None:
    """Everything the tensors' shapes, strides, dtypes and devices decide; gated=False for the
    no-residual variant, which has no update."""
    reason = _stream_reason("residual", residual, None)
    if reason is None and gated:
        reason = _stream_reason("update", update, residual)
    if reason is not None:
        return reason
    batch, dim = _stream_batch(residual), residual.shape[-1]
    for name, t in modulation:
        reason = _modulation_reason(name, t, batch, dim)
        if reason is not None:
            return reason
    tensors = [("residual", residual)]
    if gated:
        tensors.append(("update", update))
    return _common_reason(tensors + list(modulation))


def _gated_metadata_reason(residual: Any, update: Any, gate: Any, scale: Any, shift: Any) -> str | None:
    return _metadata_reason(residual, update, [("gate", gate), ("scale", scale), ("shift", shift)])


def _defer_metadata_reason(residual: Any, update: Any, gate: Any) -> str | None:
    return _metadata_reason(residual, update, [("gate", gate)])


def _modnorm_metadata_reason(x: Any, scale: Any, shift: Any) -> str | None:
    return _metadata_reason(x, None, [("scale", scale), ("shift", shift)], gated=False)


MetadataReason = Callable[..., str | None]
_NAMES: dict[MetadataReason, tuple[str, ...]] = {
    _gated_metadata_reason: ("residual", "update", "gate", "scale", "shift"),
    _defer_metadata_reason: ("residual", "update", "gate"),
    _modnorm_metadata_reason: ("residual", "scale", "shift"),
}


def _input_reason(metadata_reason: MetadataReason, args: Sequence[Any]) -> str | None:
    """Why the kernel cannot take these arguments, before any runtime state is asked."""
    return metadata_reason(*args) or _call_reason(_NAMES[metadata_reason], args)


def _decline_reason(metadata_reason: MetadataReason, args: Sequence[Any]) -> str | None:
    reason = _input_reason(metadata_reason, args)
    if reason is not None:
        return reason
    return _runtime_reason(args[0].device, args[0].shape[-1], args[0].dtype)


def _runtime_reason(device: torch.device, dim: int, dtype: torch.dtype) -> str | None:
    """Kill switch, kernel availability and the self-check for this configuration."""
    if not enabled():
        return f"disabled by {DISABLE_ENV}"
    return _CHECKER.reason(device, dim, dtype)


# The boolean guards run at every fused site, and inside a compiled graph their host time sits
# between two GPU launches. Tensors with the same shapes, strides, dtypes and devices get the same
# metadata verdict, so it is remembered: a call then costs a key, a dict lookup and the call checks
# (grad, alignment): 6 us on the H200's host against 11 us for the full checks. Bounded: cleared
# when it grows past this.
_METADATA_VERDICTS: dict[tuple, bool] = {}
_MAX_METADATA_VERDICTS = 4096


def _accepts(metadata_reason: MetadataReason, args: tuple[Any, ...]) -> bool:
    """`_decline_reason(metadata_reason, args) is None`, with the metadata verdict memoised. Never raises."""
    try:
        key = (metadata_reason, *[(t.shape, t.stride(), t.dtype, t.device) for t in args])
        accepted = _METADATA_VERDICTS.get(key)
        if accepted is None:
            accepted = metadata_reason(*args) is None
            if len(_METADATA_VERDICTS) >= _MAX_METADATA_VERDICTS:
                _METADATA_VERDICTS.clear()
            _METADATA_VERDICTS[key] = accepted
        if not accepted or _call_reason(_NAMES[metadata_reason], args) is not None:
            return False
        return _runtime_reason(args[0].device, args[0].shape[-1], args[0].dtype) is None
    except Exception:  # a guard must never be the reason a generation fails
        return False


def gated_resnorm_decline_reason(residual: Any, update: Any, gate: Any, scale: Any, shift: Any) -> str | None:
    """Why `can_use_flux2_gated_resnorm` declines these inputs, or None when it accepts them."""
    return _decline_reason(_gated_metadata_reason, (residual, update, gate, scale, shift))


def defer_decline_reason(residual: Any, update: Any, gate: Any) -> str | None:
    """Why `can_defer_flux2_gated_residual` declines this triple, or None when it accepts it."""
    return _decline_reason(_defer_metadata_reason, (residual, update, gate))


def modnorm_decline_reason(x: Any, scale: Any, shift: Any) -> str | None:
    """Why `can_use_flux2_modnorm` declines these inputs, or None when it accepts them."""
    return _decline_reason(_modnorm_metadata_reason, (x, scale, shift))


def can_use_flux2_gated_resnorm(residual: Any, update: Any, gate: Any, scale: Any, shift: Any) -> bool:
    """True when the fused kernel reproduces eager exactly for this call. Never raises."""
    return _accepts(_gated_metadata_reason, (residual, update, gate, scale, shift))


def can_defer_flux2_gated_residual(residual: Any, update: Any, gate: Any) -> bool:
    """True when `residual + gate * update` may be left pending for the next fused norm. Never raises."""
    return _accepts(_defer_metadata_reason, (residual, update, gate))


def can_use_flux2_modnorm(x: Any, scale: Any, shift: Any) -> bool:
    """True when the no-residual fused variant reproduces eager exactly. Never raises."""
    return _accepts(_modnorm_metadata_reason, (x, scale, shift))


# --------------------------------------------------------------------------- launching


@dataclass(frozen=True)
class Segment:
    """Input rows of one stream: the residual, and for a gated site the pending `gate * update`."""

    residual: torch.Tensor  # [B, T_seg, D], stride(-1) == 1
    update: torch.Tensor | None = None
    gate: torch.Tensor | None = None


def launch(
    segments: Sequence[Segment],
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float,
    *,
    write_residual: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the kernel over one or two row segments (the second follows the first along tokens).

    No validation: callers have checked the inputs with the guards. Returns (out, residual_out),
    residual_out None unless write_residual, each shaped as eager's broadcasting would shape it.
    This is the per-site hot path, so it makes no tensor views for the kernel: the C++ side reads
    [T, D] / [B, T, D] streams and [D] / [B, D] / [B, 1, D] rows as given.
    """
    first = segments[0]
    r0 = first.residual
    gate_rows = () if first.gate is None else (first.gate,)

    def empty(*rows: torch.Tensor) -> torch.Tensor:
        shape = _eager_shape(r0, *rows)
        if len(segments) == 1 and len(shape) == r0.dim():  # the residual's own shape: the cheapest call
            return torch.empty_like(r0, memory_format=torch.contiguous_format)
        tokens = sum(seg.residual.shape[-2] for seg in segments)
        return r0.new_empty((*shape[:-2], tokens, shape[-1]))

    out = empty(*gate_rows, scale, shift)
    residual_out = empty(*gate_rows) if write_residual else None
    gated = first.update is not None
    flags = (_FLAG_GATED if gated else 0) | (_FLAG_RESIDUAL_OUT if write_residual else 0)
    seg0 = (r0, first.update, first.gate) if gated else (r0, r0, r0)
    if len(segments) == 2:
        flags |= _FLAG_TWO_SEGMENTS
        second = segments[1]
        seg1 = (second.residual, second.update, second.gate) if gated else (second.residual,) * 3
    else:
        seg1 = seg0
    _CHECKER.module(r0.device).gated_resnorm(
        out,
        residual_out if residual_out is not None else out,
        scale,
        shift,
        *seg0,
        *seg1,
        r0.shape[-2],
        flags,
        float(eps),
    )
    return out, residual_out


def _eager_shape(stream: torch.Tensor, *rows: torch.Tensor) -> torch.Size:
    """The shape eager broadcasting gives `stream` op'd with accepted modulation rows: a [T, D] stream
    with a [1, 1, D] row becomes [1, T, D]. (torch.broadcast_shapes costs ~20 us a call.)"""
    if stream.dim() == 2 and any(t.dim() == 3 for t in rows):
        return torch.Size((1, *stream.shape))
    return stream.shape


def _validate(reason: str | None) -> None:
    if reason is not None:
        raise (TypeError if isinstance(reason, TypeReason) else ValueError)(f"flux2-fused: {reason}")


def flux2_gated_resnorm_raw(
    residual: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel, unguarded by the self-check: returns fresh (out, residual_out).

    Inputs are never modified. Unsupported inputs raise TypeError (types, dtypes, devices) or
    ValueError (shapes, strides, alignment, sizes) naming the problem.
    """
    _validate(_input_reason(_gated_metadata_reason, (residual, update, gate, scale, shift)))
    return gated_resnorm_unchecked(residual, update, gate, scale, shift, eps)


def gated_resnorm_unchecked(
    residual: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`flux2_gated_resnorm_raw` for inputs a guard has just accepted: no second validation."""
    out, residual_out = launch([Segment(residual, update, gate)], scale, shift, eps, write_residual=True)
    assert residual_out is not None
    return out, residual_out


def flux2_modnorm_raw(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """The fused no-residual variant, `(1 + scale) * layer_norm(x) + shift`, unguarded by the self-check."""
    _validate(_input_reason(_modnorm_metadata_reason, (x, scale, shift)))
    return modnorm_unchecked(x, scale, shift, eps)


def modnorm_unchecked(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    """`flux2_modnorm_raw` for inputs a guard has just accepted: no second validation."""
    return launch([Segment(x)], scale, shift, eps, write_residual=False)[0]


# --------------------------------------------------------------------------- self-check


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality that allows NaN payloads to differ but not NaN positions."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a_nan, b_nan = a.isnan(), b.isnan()
    if not torch.equal(a_nan, b_nan):
        return False
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(bits)[~a_nan], b.view(bits)[~b_nan])


def _edge_rows(x: torch.Tensor, big: float, small: float) -> None:
    """Overwrite the first rows of a [B, T, D] input with the cases that break naive kernels."""
    dim = x.shape[-1]
    x[0, 0] = 0.375  # constant row: variance 0
    x[0, 1] *= big
    x[0, 2] *= small
    x[0, 3, 5 % dim] = float("nan")
    x[0, 4, 7 % dim] = float("inf")
    x[0, 5, ::2] = -float("inf")
    x[1, 0] = x[1, 0, 0]  # constant row in the second batch too


def random_bits(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A 16-bit float tensor with every bit pattern equally likely: subnormals, NaN and Inf included."""
    raw = torch.randint(-(2**15), 2**15, tuple(shape), generator=gen, device=gen.device, dtype=torch.int32)
    return raw.to(torch.int16).view(dtype)


def self_check(device: torch.device, dim: int, dtype: torch.dtype) -> tuple[bool, str]:
    """Compare the kernel with live eager for one configuration: (passed, what was compared)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))
    big, small = (3e4, 1e-4) if dtype == torch.float16 else (1e30, 1e-30)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    batch, tokens = 2, 37
    residual, update = randn(batch, tokens, dim), randn(batch, tokens, dim)
    _edge_rows(residual, big, small)
    update[0, 1] *= 1e3
    mod = randn(batch, 1, 6 * dim)
    shift, scale, gate = mod.chunk(6, dim=-1)[:3]  # FLUX.2's strided [B, 1, D] chunk views
    # Every bit pattern (NaN, Inf, subnormals) in all five inputs: the kernel's packed T-pair math
    # equals eager's fp32-then-round steps by a proof that leans on the hardware's rounding.
    noise = [random_bits(shape, dtype, gen) for shape in [(batch, tokens, dim)] * 2 + [(batch, 1, dim)] * 3]
    cases = {
        "gated, per-batch modulation": ([Segment(residual, update, gate)], scale, shift),
        "gated, broadcast modulation": ([Segment(residual, update, gate[:1, 0])], scale[0, 0], shift[:1, 0]),
        "no residual": ([Segment(residual)], scale, shift),
        "random bit patterns": ([Segment(*noise[:3])], noise[3], noise[4]),
    }
    for name, (segments, sc, sh) in cases.items():
        seg = segments[0]
        out, res_out = launch(segments, sc, sh, 1e-6, write_residual=seg.update is not None)
        if seg.update is not None:
            ref_out, ref_res = gated_resnorm_reference(seg.residual, seg.update, seg.gate, sc, sh)
            if res_out is None or not bits_equal(res_out, ref_res):
                return False, f"{name}: residual_out differs from eager"
        else:
            ref_out = modnorm_reference(seg.residual, sc, sh)
        if not bits_equal(out, ref_out):
            return False, f"{name}: out differs from eager"
    torch.cuda.synchronize(device)
    return True, f"{len(cases)} cases x [{batch}, {tokens}, {dim}] {dtype}, random + edge rows + random bits"


@dataclass
class CheckRecord:
    passed: bool
    detail: str
    seconds: float


class _Checker:
    """Process-wide state: loaded modules per architecture, self-check verdicts per configuration."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._by_device: dict[torch.device, Any] = {}
        self._build_errors: dict[str, str] = {}
        self.records: dict[tuple[torch.device, int, torch.dtype], CheckRecord] = {}
        self._warned: set[str] = set()

    def warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(f"flux2-fused: {message}; using eager PyTorch", RuntimeWarning, stacklevel=4)

    def module(self, device: torch.device) -> Any:
        """The loaded kernel module for this device's architecture (raises BuildError)."""
        mod = self._by_device.get(device)
        if mod is not None:
            return mod
        arch = jit.device_arch(device)
        with self._lock:
            if arch in self._build_errors:
                raise jit.BuildError(self._build_errors[arch])
            try:
                mod = self._by_device[device] = jit.load_module(arch)
            except Exception as exc:
                self._build_errors[arch] = str(exc)
                raise jit.BuildError(str(exc)) from exc
            return mod

    def reason(self, device: torch.device, dim: int, dtype: torch.dtype) -> str | None:
        key = (device, dim, dtype)  # the torch version is fixed for the process
        record = self.records.get(key)
        if record is None:
            if torch.cuda.is_current_stream_capturing():
                return (
                    "configuration not yet self-checked, and checking is impossible during CUDA graph capture"
                )
            with self._lock:
                record = self.records.get(key)
                if record is None:
                    record = self._check(device, dim, dtype)
                    self.records[key] = record
        return None if record.passed else f"self-check failed: {record.detail}"

    def _check(self, device: torch.device, dim: int, dtype: torch.dtype) -> CheckRecord:
        start = time.perf_counter()
        try:
            self.module(device)
            with torch.inference_mode():
                passed, detail = self_check(device, dim, dtype)
        except Exception as exc:
            passed, detail = False, f"{type(exc).__name__}: {exc}"
        record = CheckRecord(passed, detail, time.perf_counter() - start)
        if not passed:
            self.warn_once(f"fused kernel disabled for D={dim}, {dtype} on {device} ({detail})")
        return record


_CHECKER = _Checker()


def self_check_records() -> dict[tuple[str, int, str, str], CheckRecord]:
    """The verdicts so far: (device, D, dtype, torch version) -> record with its one-time cost."""
    return {
        (str(device), dim, str(dtype), torch.__version__): record
        for (device, dim, dtype), record in _CHECKER.records.items()
    }
