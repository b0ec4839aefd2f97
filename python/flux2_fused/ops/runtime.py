"""Process-wide state every fused op shares: the kill switch, and the live self-check verdicts.

A fused op runs only where it is proven exact. The guards prove what the inputs' metadata can
prove; this module holds what only running can: before an op's first fused call for a configuration
(the op decides what a configuration is: hidden size, dtype, ...), its kernel is compared with live
eager on fresh random and edge inputs on that device, and a single differing bit disables that
configuration of that op for the rest of the process (one warning). A kernel that cannot be built
fails its self-check the same way. Records are keyed by op, device and configuration, so ops never
share verdicts.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from . import jit

DISABLE_ENV = "FLUX2_FUSED_DISABLE"
_TRUE_VALUES = ("1", "true", "yes", "on")
# What every op's kernel computes in; the ops' guards take these and nothing else.
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def kill_switch() -> bool:
    """True when the environment variable FLUX2_FUSED_DISABLE turns every fused op off."""
    value = os.environ.get(DISABLE_ENV)
    return value is not None and value.strip().lower() in _TRUE_VALUES


@functools.cache
def capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, asked once: the quantizing forms' guards need it on every
    call, and torch's query costs more host time than the rest of a guard's verdict."""
    return torch.cuda.get_device_capability(device)


def fast_path_reason(device: torch.device | str, dtype: torch.dtype | None = None) -> str | None:
    """Why no fused op can run on `device` (in `dtype`, when given), in one line; None when some may.

    The one answer to "is the fast path on here" for the CLI, the benchmarks and the docs:
    a CUDA device of compute capability 8.0 or newer, bf16 or fp16, the kill switch unset, and a
    module for at least one op (`module_sources`: bundled in the wheel, cached, or built with a
    local toolkit). The ops may still decline single calls (shapes, strides, autograd, ...), each
    with its own reason.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return f"the fused ops run on CUDA GPUs, not on {device.type}"
    if not torch.cuda.is_available():
        return "no CUDA GPU is available"
    reason = jit.arch_reason(jit.device_arch(device))
    if reason is not None:
        return f"{torch.cuda.get_device_name(device)}: {reason}"
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        return f"the kernels compute in bf16 and fp16, not {str(dtype).removeprefix('torch.')}"
    if kill_switch():
        return f"disabled by {DISABLE_ENV}"
    sources = module_sources(device)
    if any(source is not None for source, _ in sources.values()):
        return None
    return "; ".join(sorted({reason for _, reason in sources.values() if reason is not None}))


def module_sources(device: torch.device | str) -> dict[str, tuple[str | None, str | None]]:
    """Each op's module source on a CUDA `device` (`jit.module_source`): op name -> (where its module
    comes from, None) or (None, why it has none), as the ops' loader will find them."""
    from . import OPS  # the op packages import this module

    arch = jit.device_arch(torch.device(device))
    return {op.name: jit.module_source(op.spec, arch) for op in OPS}


def float8_unbuilt(device: torch.device, config: Any) -> str | None:
    """Why a configuration's kernel is not built for `device`, for the ops whose configurations say
    whether they are a quantizing form (`config.quantized`): those are built for sm_89 and newer
    only (the GPUs with float8 GEMMs; older ones never quantize an activation to float8). None
    where it is built."""
    if config.quantized and capability(device) < (8, 9):
        return "the quantizing kernel needs sm_89 or newer (float8 GEMMs)"
    return None


@dataclass(frozen=True)
class FusedOp:
    """What the shared machinery needs to know of one op.

    self_check(device, config) compares the kernel with eager for one configuration and returns
    (passed, what was compared); verify_configs are the configurations `flux2-fused verify` checks;
    unbuilt(device, config) says why a configuration's kernel is not built for that device's GPU
    (None where it is), so that neither the self-check nor verify launches it there.
    """

    name: str
    spec: jit.KernelSpec
    self_check: Callable[[torch.device, Hashable], tuple[bool, str]]
    verify_configs: tuple[Hashable, ...] = ()
    unbuilt: Callable[[torch.device, Hashable], str | None] = lambda device, config: None


@dataclass
class CheckRecord:
    """One self-check verdict and what it cost."""

    passed: bool
    detail: str
    seconds: float


_lock = threading.RLock()
_records: dict[tuple[str, torch.device, Hashable], CheckRecord] = {}
_warned: set[str] = set()


def warn_once(message: str) -> None:
    """One RuntimeWarning per distinct message and process: a failure says so once, then stays eager."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(f"flux2-fused: {message}; using eager PyTorch", RuntimeWarning, stacklevel=4)


def runtime_reason(op: FusedOp, device: torch.device, config: Hashable) -> str | None:
    """Why `op` may not run on `device` for `config` right now: the kill switch, a failed build or a
    failed self-check; None when it may. The first call for a configuration runs the self-check,
    except during CUDA graph capture, where it cannot run and the call declines instead."""
    if kill_switch():
        return f"disabled by {DISABLE_ENV}"
    if torch.is_autocast_enabled(device.type):
        # Autocast runs norms (layer_norm, rms_norm) in float32: eager's bits are then not the chain
        # the kernels reproduce.
        return "autocast is enabled (it changes the dtypes eager computes in)"
    key = (op.name, device, config)
    record = _records.get(key)
    if record is None:
        if torch.cuda.is_current_stream_capturing():
            return "configuration not yet self-checked, and checking is impossible during CUDA graph capture"
        with _lock:
            record = _records.get(key)
            if record is None:
                record = _records[key] = _check(op, device, config)
    return None if record.passed else f"self-check failed: {record.detail}"


def _check(op: FusedOp, device: torch.device, config: Hashable) -> CheckRecord:
    start = time.perf_counter()
    try:
        jit.module_for(op.spec, device)
    except jit.BuildError as exc:
        warn_once(f"the {op.name} kernel is unavailable ({exc})")
        return CheckRecord(False, f"BuildError: {exc}", time.perf_counter() - start)
    try:
        with torch.inference_mode():
            passed, detail = op.self_check(device, config)
    except Exception as exc:
        passed, detail = False, f"{type(exc).__name__}: {exc}"
    record = CheckRecord(passed, detail, time.perf_counter() - start)
    if not passed:
        warn_once(f"{op.name} disabled for {config} on {device} ({detail})")
    return record


def self_check_records() -> dict[tuple[str, str, str, str], CheckRecord]:
    """The verdicts so far: (op, device, configuration, torch version) -> record with its one-time cost."""
    return {
        (name, str(device), str(config), torch.__version__): record
        for (name, device, config), record in _records.items()
    }
