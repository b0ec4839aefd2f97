"""What the row-wise elementwise ops (`swiglu`, `gelu_tanh`) share: their layout, guards, entry points
and operator.

Such an op maps each row of x to a row of out, element by element: x is [B, S, C] or [S, C] rows
with unit inner stride (rows and batch possibly strided: a view of a wider projection), holding
`operands` H-wide operands side by side (swiglu's a and b, gelu_tanh's one), and out is [..., H], the
same rows (possibly half of a wider buffer, which the single block's output projection reads). A
two-operand op also takes its operands as two tensors of out's shape: x the first, `b` the second
(Z-Image's feed-forward, `silu(w1(x)) * w3(x)`, has two projections where FLUX.2 has one). The
kernels (csrc/rowwise.cuh) move 4 elements (8 bytes) at a time, so H is a positive multiple of 4 and
row and batch strides are multiples of 4 elements (the quantizing kernel moves 8 where every row it
reads allows it, a choice its launch makes from the pointers and strides: nothing to guard here).

The quantizing form (`RowOp.quantized`) gives, in place of the activation, what the next torchao
float8 Linear would make of it: the row [prefix | op(x)] (a single block's attention output beside
its activation, or op(x) alone), each value rounded to the dtype as eager's buffer holds it, as
e4m3fn bytes and float32 scales, torchao's bits (`float8_quant`, docs/numerics.md 15). With a scale
a row, one kernel writes them and the activation itself is never written. With one scale for the
tensor, whose amax needs every row first, the joint form writes the joint rows and each row's amax
word, and `float8_quant` streams them with the scale it reduces from those words: two launches, no
copy of the prefix and no pass of its own over the rows for the amax.

`RowGuards` words the checks once for every such op; `RowOp` makes the decisions every such op
makes the same way (`fused`, `apply`, `concat`, `quantized`, the validated call), `define_operator`
its torch.library operator, and `Config`, `compare` and `fused_op` its self-check's verdicts. Each
op's package names them and says in its docstrings what it computes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import float8_quant, jit, runtime
from .bits import bits_equal, every_bit_pattern
from .float8_quant.reference import GRANULARITIES
from .runtime import FusedOp
from .verdicts import Guard, Reason, TypeReason, raise_for


@dataclass(frozen=True)
class Config:
    """What one self-check verdict of a row-wise op covers, with the device and the torch version:
    its kernel for a dtype, or its kernel for torchao's float8 scaled per `quantized` ("row": the
    quantizing epilogue; "tensor": the joint form)."""

    dtype: torch.dtype
    quantized: str | None = None

    def __str__(self) -> str:
        kind = f" quantized per {self.quantized}" if self.quantized else ""
        return str(self.dtype).removeprefix("torch.") + kind


# The widest joint row the quantizing kernel stages in a block's shared memory (48 KB of bf16).
MAX_QUANTIZED_WIDTH = 24576


def rows_reason(name: str, t: Any) -> Reason:
    """Why `t` is not [B, S, C] or [S, C] rows the kernels can walk (unit inner stride, row and batch
    strides multiples of 4 elements), or None."""
    if not isinstance(t, torch.Tensor):
        return TypeReason(f"{name} is not a tensor")
    if t.dim() not in (2, 3):
        return f"{name} must be [B, S, C] or [S, C], got {tuple(t.shape)}"
    if t.stride(-1) != 1:
        return f"{name} has inner stride {t.stride(-1)} (needs 1)"
    for axis, what in ((-2, "row"), (0, "batch")):
        counts = t.dim() == 3 or axis == -2  # a 2-D view has no batch axis
        if counts and t.shape[axis] > 1 and t.stride(axis) % 4 != 0:
            return f"{name} {what} stride {t.stride(axis)} is not a multiple of 4 elements"
    return None


def overlap_reason(x: torch.Tensor, out: torch.Tensor, name: str = "x") -> Reason:
    """Per call (storage is not metadata): out must not share the storage of an input (`name`),
    since blocks read and write rows in no fixed order."""
    if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        return f"out shares storage with {name}"
    return None


# What x's channel count must be beside b (the two-tensor form: x holds one operand).
PAIR_CHANNELS = "a positive multiple of 4 beside b"


class RowGuards:
    """One row-wise op's guards: `plain` over x alone, `into` over x and a destination out.

    operands: the H-wide operands a row of x holds (out is H wide); channels: what x's channel count
    must be, in words; out_shape: what out's shape must be, in words. The runtime part asks `op`'s
    self-check for x's (device, dtype). `pair` and `pair_into` guard the two-tensor form (x and b)
    of a two-operand op.
    """

    def __init__(self, op: FusedOp, operands: int, channels: str, out_shape: str) -> None:
        self.op = op
        self.operands = operands
        self.channels = channels
        self.out_shape = out_shape
        self.plain = Guard(("x",), self._metadata_reason, self._runtime_reason)
        self.into = Guard(("x", "out"), self._metadata_reason, self._runtime_reason)
        self.pair = Guard(("x", "b"), self._pair_reason, self._runtime_reason)
        self.pair_into = Guard(("x", "b", "out"), self._pair_reason, self._runtime_reason)
        # the quantizing form's guards by (granularity, arguments after x)
        self._quantized: dict[tuple[str, str], Guard] = {}
        for kind in GRANULARITIES:
            runtime_reason = functools.partial(self._quantized_runtime_reason, kind)
            self._quantized[kind, ""] = Guard(("x",), self._quantized_reason, runtime_reason)
            self._quantized[kind, "prefix"] = Guard(("x", "prefix"), self._quantized_reason, runtime_reason)
            pair = Guard(("x", "b"), lambda x, b: self._quantized_reason(x, b=b), runtime_reason)
            self._quantized[kind, "b"] = pair

    def width(self, x: torch.Tensor) -> int:
        """H: the width of out's rows for x."""
        return x.shape[-1] // self.operands

    def _metadata_reason(self, x: Any, out: Any = None, b: Any = None) -> Reason:
        """Everything the tensors' shapes, strides, dtypes and devices decide; with b, x holds the
        first operand and b the second."""
        reason = rows_reason("x", x)
        if reason is not None:
            return reason
        in_x, channels = (self.operands, self.channels) if b is None else (1, PAIR_CHANNELS)
        if x.shape[-1] % (4 * in_x) != 0 or x.shape[-1] == 0:
            return f"x has {x.shape[-1]} channels, the kernel needs {channels}"
        if x.device.type != "cuda":
            return TypeReason(f"x is on {x.device}, the fused kernel needs CUDA")
        if x.dtype not in runtime.SUPPORTED_DTYPES:
            return TypeReason(f"dtype {x.dtype} is not supported (bfloat16, float16)")
        width, wanted = (self.width(x), self.out_shape) if b is None else (x.shape[-1], "x's shape")
        for name, t in (("b", b), ("out", out)):
            if t is None:
                continue
            reason = rows_reason(name, t)
            if reason is not None:
                return reason
            if t.dtype != x.dtype or t.device != x.device:
                return TypeReason(f"{name} is {t.dtype} on {t.device}, x is {x.dtype} on {x.device}")
            if t.shape != (*x.shape[:-1], width):
                return f"{name} shape {tuple(t.shape)} is not {wanted}"
        return None

    def _pair_reason(self, x: Any, b: Any, out: Any = None) -> Reason:
        """The metadata checks of the two-tensor form (x the first operand, b the second)."""
        return self._metadata_reason(x, out, b)

    def _quantized_reason(self, x: Any, prefix: Any = None, b: Any = None) -> Reason:
        """The metadata checks of the quantizing form: x (and b) as for an activation, prefix rows
        like x's, the joint row a multiple of 8 wide (torchao's float8 GEMM) up to
        MAX_QUANTIZED_WIDTH."""
        reason = self._metadata_reason(x, None, b)
        if reason is not None:
            return reason
        width = self.width(x) if b is None else x.shape[-1]
        if prefix is not None:
            reason = rows_reason("prefix", prefix)
            if reason is not None:
                return reason
            if prefix.dtype != x.dtype or prefix.device != x.device:
                where = f"prefix is {prefix.dtype} on {prefix.device}"
                return TypeReason(f"{where}, x is {x.dtype} on {x.device}")
            if prefix.shape[:-1] != x.shape[:-1] or prefix.shape[-1] % 4 != 0:
                return f"prefix shape {tuple(prefix.shape)} is not x's rows, a multiple of 4 wide"
            width += prefix.shape[-1]
        if width % 8 != 0 or width > MAX_QUANTIZED_WIDTH:
            return f"a joint row of {width} is not a multiple of 8 up to {MAX_QUANTIZED_WIDTH}"
        return None

    def _runtime_reason(self, x: torch.Tensor, *_: Any) -> Reason:
        """Kill switch, kernel build and the self-check for this (device, dtype)."""
        return runtime.runtime_reason(self.op, x.device, Config(x.dtype))

    def _quantized_runtime_reason(self, granularity: str, x: torch.Tensor, *_: Any) -> Reason:
        """The same for the quantizing form's kernel of `granularity`, which is built for sm_89 and
        newer only (the GPUs with float8 GEMMs)."""
        config = Config(x.dtype, quantized=granularity)
        return self.op.unbuilt(x.device, config) or runtime.runtime_reason(self.op, x.device, config)

    def quantized_reason(self, x: Any, prefix: Any = None, b: Any = None, granularity: str = "row") -> Reason:
        """Why the quantizing form declines x (after prefix, or with b), or None when it accepts."""
        guard, rest = self.quantized_guard(prefix, b, granularity)
        return guard.reason(x, *rest)

    def quantized_guard(self, prefix: Any, b: Any, granularity: str = "row") -> tuple[Guard, tuple[Any, ...]]:
        """The guard of this quantizing call (a prefix, or b, or neither), and its arguments after x."""
        if prefix is not None and b is not None:
            raise ValueError("the quantizing form takes a prefix or b, not both")
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity {granularity!r} is not one of {', '.join(GRANULARITIES)}")
        if prefix is not None:
            return self._quantized[granularity, "prefix"], (prefix,)
        return (
            (self._quantized[granularity, ""], ()) if b is None else (self._quantized[granularity, "b"], (b,))
        )

    def _guard(self, out: Any, b: Any) -> tuple[Guard, tuple[Any, ...]]:
        """The guard of this form of call, and its arguments after x."""
        if b is None:
            return (self.plain, ()) if out is None else (self.into, (out,))
        return (self.pair, (b,)) if out is None else (self.pair_into, (b, out))

    @staticmethod
    def _overlap(x: Any, out: Any, b: Any) -> Reason:
        if out is None:
            return None
        return overlap_reason(x, out) or (None if b is None else overlap_reason(b, out, "b"))

    def reason(self, x: Any, out: Any = None, b: Any = None) -> Reason:
        """Why the kernel declines x (with b, and the destination out), or None when it accepts them."""
        guard, rest = self._guard(out, b)
        return guard.reason(x, *rest) or self._overlap(x, out, b)

    def accepts(self, x: Any, out: Any = None, b: Any = None) -> bool:
        """`reason(x, out, b) is None`, with the metadata verdict remembered. Never raises."""
        guard, rest = self._guard(out, b)
        try:
            return guard(x, *rest) and self._overlap(x, out, b) is None
        except Exception:  # not tensors: declined, as the guards decline garbage
            return False

    def validate(self, x: Any, out: Any = None, b: Any = None) -> None:
        """Raise TypeError (types, dtypes, devices) or ValueError (shapes, strides, alignment, overlap)
        naming what the kernel cannot take (runtime state aside)."""
        guard, rest = self._guard(out, b)
        guard.validate(x, *rest)
        raise_for(self._overlap(x, out, b))


@dataclass(frozen=True)
class RowOp:
    """One row-wise op's entry points, from its guards, its launcher (`launch(x, out)`, out None for a
    fresh tensor), its eager reference and its library operator (`operator(x)`, resolved when a
    torch.compile trace first reaches the op). A two-operand op's launcher, reference and operator
    also take the second operand as a tensor of its own (`b`, after out for the launcher)."""

    guards: RowGuards
    launch: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]
    operator: Callable[..., torch.Tensor]
    # launch_quantized(x, prefix, b) -> (q, scale): the kernel with the quantizing epilogue
    launch_quantized: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # launch_joint(x, prefix, b) -> (joint rows, their amax words): the joint form
    launch_joint: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    def fused(
        self, x: torch.Tensor, out: torch.Tensor | None = None, b: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """op(x) (op(x, b)) from one kernel launch (into `out` when given), or None where the guards
        decline."""
        if not self.guards.accepts(x, out, b):
            return None
        return self.launch(x, out) if b is None else self.launch(x, out, b)

    def apply(
        self,
        x: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        b: torch.Tensor | None = None,
        enabled: bool = True,
    ) -> torch.Tensor:
        """The site's one decision: under a torch.compile trace the library operator, else `fused`
        where it accepts, else the eager reference; into `out` when given. The same bits every way.
        `enabled=False` (a model's switch) always runs the eager reference."""
        operands = (x,) if b is None else (x, b)
        if enabled and torch.compiler.is_compiling():
            result = self.operator(*operands)
            return result if out is None else out.copy_(result)
        result = self.fused(x, out, b) if enabled else None
        if result is not None:
            return result
        eager = self.reference(*operands)
        return eager if out is None else out.copy_(eager)

    def concat(self, prefix: torch.Tensor, x: torch.Tensor, *, enabled: bool = True) -> torch.Tensor:
        """`cat([prefix, op(x)], dim=-1)`, as a single block feeds its output projection: in eager
        mode op(x) is written straight into its half of the joint buffer, so nothing is concatenated
        afterwards; under a trace or switched off, the eager `cat` (the compiled graph keeps it: the
        operator returns a fresh tensor)."""
        if not enabled or torch.compiler.is_compiling():
            return torch.cat([prefix, self.apply(x, enabled=enabled)], dim=-1)
        width = prefix.shape[-1]
        joint = prefix.new_empty((*prefix.shape[:-1], width + self.guards.width(x)))
        joint[..., :width].copy_(prefix)
        self.apply(x, out=joint[..., width:])
        return joint

    def quantized(
        self,
        x: torch.Tensor,
        *,
        prefix: torch.Tensor | None = None,
        b: torch.Tensor | None = None,
        granularity: str = "row",
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q, scale): the row [prefix | op(x)] (op(x, b)) as torchao's float8, the bytes [..., P + H]
        and float32 scales per `granularity` ([..., 1] a row from one launch, or all ones for the
        tensor from the joint form and `float8_quant`); None where the guards decline or under a
        torch.compile trace (the caller then computes the activation, and the Linear quantizes it)."""
        if torch.compiler.is_compiling():
            return None
        guard, rest = self.guards.quantized_guard(prefix, b, granularity)
        if not guard(x, *rest):
            return None
        if granularity == "row":
            return self.launch_quantized(x, prefix, b)
        joint, words = self.launch_joint(x, prefix, b)
        return float8_quant.apply(joint, "tensor", words=words)

    def validated(
        self, x: torch.Tensor, out: torch.Tensor | None = None, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The kernel, without the self-check. Unsupported inputs raise TypeError (types, dtypes,
        devices) or ValueError (shapes, strides, alignment, overlap) naming the problem."""
        self.guards.validate(x, out, b)
        return self.launch(x, out) if b is None else self.launch(x, out, b)


def joint_outputs(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh (joint, words) for the joint form over x's rows: the rows [..., width] in x's dtype,
    contiguous, and an int32 amax word a row."""
    rows = x.numel() // x.shape[-1]
    joint = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
    return joint, torch.empty(rows, dtype=torch.int32, device=x.device)


def quantized_outputs(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh (q, scale) for the quantizing form over x's rows: e4m3fn [..., width] and float32
    [..., 1], the shapes torchao's per-row quantization of a [..., width] activation has."""
    q = torch.empty((*x.shape[:-1], width), dtype=torch.float8_e4m3fn, device=x.device)
    return q, torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)


def compare(
    device: torch.device,
    cases: Mapping[str, tuple[torch.Tensor | None, ...]],
    launch: Callable[..., torch.Tensor],
    reference: Callable[..., torch.Tensor],
    detail: str,
) -> tuple[bool, str]:
    """A self-check's verdict over its cases (name -> (x, out or None), or (x, out or None, b) for the
    two-tensor form): (False, the first case whose kernel output is not eager's bit for bit,
    `bits_equal`), else (True, `detail`)."""
    for name, (x, out, *b) in cases.items():
        if not bits_equal(launch(x, out, *b), reference(x, *b)):
            return False, f"{name}: differs from eager"
    torch.cuda.synchronize(device)
    return True, detail


def quantizing_cases(
    device: torch.device, dtype: torch.dtype, gen: torch.Generator, operands: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """The quantizing kernels' self-check cases (x, prefix, b) for an op of `operands` operands:
    random rows with edge rows (zero, tiny, huge values, NaN, +-Inf: each scale's long path), a
    prefix beside strided operand rows, random bit patterns, a joint row wider than the narrow
    kernel's, rows 8 bytes into their buffer (the kernel's 8-byte form; every other case is whole
    16-byte vectors), every value of the dtype as the first operand (the joint form's rows show each
    one's result exactly, where per-row bytes round most of its bits away), and for two operands
    the two-tensor form; with one scale for the tensor, the random rows alone too (the edge rows
    make every element NaN)."""
    from .bits import random_bits

    batch, tokens, hidden = 2, 13, 200
    x = (torch.randn(batch, tokens, operands * hidden, generator=gen, device=device) * 4).to(dtype)
    x[0, 0] = 0.0
    x[0, 1] *= 1e-6
    x[0, 2] = torch.finfo(dtype).max / 4
    x[0, 3, 3], x[0, 4, 5], x[0, 5, 7] = float("nan"), float("inf"), -float("inf")
    wide = torch.randn(batch, tokens, 3 * hidden + operands * hidden, generator=gen, device=device).to(dtype)
    prefix = (torch.randn(batch, tokens, 3 * hidden, generator=gen, device=device) * 2).to(dtype)
    long_row = torch.randn(1, 3, operands * 13000, generator=gen, device=device).to(dtype)
    every = every_bit_pattern(dtype, device).view(16, 4096)
    others = torch.randn(16, 4096 * (operands - 1), generator=gen, device=device).to(dtype)
    cases = {
        "random rows": (x[1:], None, None),
        "random and edge rows": (x, None, None),
        "a prefix beside strided rows": (wide[..., 3 * hidden :], prefix, None),
        "random bit patterns after a prefix": (
            random_bits((batch, tokens, operands * hidden), dtype, gen),
            random_bits((batch, tokens, 3 * hidden), dtype, gen),
            None,
        ),
        "a row of 19000 after a prefix": (long_row, torch.randn(1, 3, 6000, device=device).to(dtype), None),
        "rows 8 bytes into their buffer": (wide[..., 4 : 4 + operands * hidden], None, None),
        "every value of the dtype as the first operand": (torch.cat([every, others], dim=-1), None, None),
    }
    if operands == 2:
        cases["two projections"] = (x[..., :hidden].contiguous(), None, x[..., hidden:].contiguous())
    return cases


def compare_quantized(
    device: torch.device,
    cases: Mapping[str, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]],
    launch_quantized: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    launch_joint: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    reference: Callable[..., torch.Tensor],
    config: Config,
) -> tuple[bool, str]:
    """The verdict of the quantizing form scaled per `config.quantized` over its cases (name -> (x,
    prefix or None, b or None)): its bytes and scales against torchao's quantization
    (`float8_quant.reference`, eager's kernels) of eager's joint row, `cat([prefix, reference(x[,
    b])])`; per tensor, the joint rows and the quantization the fused `float8_quant` makes of them
    with the joint form's words too."""
    from .float8_quant.selfcheck import same

    for name, (x, prefix, b) in cases.items():
        value = reference(x) if b is None else reference(x, b)
        joint = value if prefix is None else torch.cat([prefix, value], dim=-1)
        expected = float8_quant.reference.quantize(joint, config.quantized)
        if config.quantized == "row":
            got = launch_quantized(x, prefix, b)
        else:
            rows, words = launch_joint(x, prefix, b)
            if not bits_equal(rows, joint):
                return False, f"{name}: joint rows differ from eager"
            got = float8_quant.launch(rows, "tensor", words)
        if not same(got, expected):
            return False, f"{name}: differs from eager"
    torch.cuda.synchronize(device)
    return True, f"{len(cases)} quantizing cases {config}, edge rows + random bits"


def fused_op(
    name: str, spec: jit.KernelSpec, self_check: Callable[[torch.device, Config], tuple[bool, str]]
) -> FusedOp:
    """A row-wise op's `FusedOp`: one self-check verdict per (device, dtype) for each of its kernels;
    `flux2-fused verify` checks bf16 and fp16, plain and quantizing."""
    kinds = (None, *GRANULARITIES)
    configs = tuple(Config(dtype, kind) for kind in kinds for dtype in runtime.SUPPORTED_DTYPES)
    return FusedOp(
        name=name, spec=spec, self_check=self_check, verify_configs=configs, unbuilt=runtime.float8_unbuilt
    )


def define_operator(
    name: str,
    apply: Callable[..., torch.Tensor],
    reference: Callable[..., torch.Tensor],
    operands: int,
) -> tuple[torch.library.Library, Any]:
    """`torch.ops.flux2_fused.<name>(Tensor x) -> Tensor` (`(Tensor x, Tensor? b=None)` for an op of two
    operands, b the second as a tensor of its own): `apply` below autograd (the kernel where the
    guards accept, decided when the op runs, the eager reference elsewhere), the differentiable
    `reference` where a gradient is needed, and a fake of out's rows (1/`operands` of x's width, or
    x's with b). Returns the library fragment (keep it alive) and the operator's default overload."""
    lib = torch.library.Library("flux2_fused", "FRAGMENT")
    lib.define(f"{name}(Tensor x{', Tensor? b=None' if operands == 2 else ''}) -> Tensor")
    operator = getattr(torch.ops.flux2_fused, name).default

    def implementation(x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return apply(x) if b is None else apply(x, b=b)

    def autograd(x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """The eager reference (differentiable) when a gradient is needed, else the implementation
        below autograd. Inference mode never reaches it."""
        args = (x,) if b is None else (x, b)
        if torch.is_grad_enabled() and any(t.requires_grad for t in args):
            return reference(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return operator(*args)

    def fake(x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], x.shape[-1] if b is not None else x.shape[-1] // operands))

    lib.impl(name, implementation, "CompositeExplicitAutograd")
    lib.impl(name, autograd, "Autograd")
    torch.library.register_fake(f"flux2_fused::{name}", fake, lib=lib)
    return lib, operator
