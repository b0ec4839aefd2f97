"""The live self-check: the sandwich-norm kernel against eager on this device, once per dtype, row
width and process.

It feeds every variant Z-Image's blocks call (the first norm with and without a scale, the gated
update with the next norm and a scale, the block's last update alone, the refiners' ungated ones),
rows that break naive kernels (constant, zero, huge, tiny, NaN, +-Inf), gates and scales one a batch
element and shared, and rows and weights of random bit patterns; its quantizing form (out as
torchao's per-row float8) has a verdict of its own over the cases with a next norm.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .. import runtime
from ..bits import bits_equal, random_bits
from ..runtime import FusedOp
from . import reference
from .launch import SPEC, launch, launch_quantized

HIDDEN = 3840  # Z-Image's width: the verdict's default configuration


@dataclass(frozen=True)
class Config:
    """What one self-check verdict covers, with the device and the torch version: the rows' dtype and
    width (aten's reduction of the variance depends on it), or (`quantized="row"`) its quantizing
    form, out as torchao's per-row float8."""

    dtype: torch.dtype
    hidden: int = HIDDEN
    quantized: str | None = None

    def __str__(self) -> str:
        kind = f" quantized per {self.quantized}" if self.quantized else ""
        return f"D={self.hidden} {str(self.dtype).removeprefix('torch.')}{kind}"


def _edge_rows(x: torch.Tensor, big: float, small: float) -> None:
    x[0, 0] = 0.375
    x[0, 1] = 0.0
    x[0, 2] *= big
    x[0, 3] *= small
    x[0, 4, 5] = float("nan")
    x[0, 5, 7] = float("inf")
    x[0, 6, ::3] = -float("inf")


def self_check(device: torch.device, config: Config) -> tuple[bool, str]:
    """Compare the kernel with live eager for one dtype and width: (passed, what was compared)."""
    dtype, hidden = config.dtype, config.hidden
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))
    big, small = (3e2, 1e-3) if dtype == torch.float16 else (1e18, 1e-18)
    batch, tokens = 2, 21

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)

    x, update = randn(batch, tokens, hidden), randn(batch, tokens, hidden, std=4.0)
    _edge_rows(x, big, small)
    _edge_rows(update[:, 3:], big, small)
    weight, update_weight = randn(hidden), randn(hidden)
    gate, scale = randn(batch, 1, hidden).tanh(), 1.0 + randn(batch, 1, hidden)
    noise = [random_bits((batch, tokens, hidden), dtype, gen) for _ in range(2)]
    noise_weights = [random_bits((hidden,), dtype, gen) for _ in range(2)]
    noise_rows = [random_bits((batch, 1, hidden), dtype, gen) for _ in range(2)]
    cases = {
        "first norm with a scale": (x, weight, scale, None, None, None),
        "first norm alone": (x, weight, None, None, None, None),
        "gated update, next norm with a scale": (x, weight, scale, update, update_weight, gate),
        "gated update alone": (x, None, None, update, update_weight, gate),
        "ungated update, next norm": (x, weight, None, update, update_weight, None),
        "one gate and scale for every batch element": (x, weight, scale[:1], update, update_weight, gate[:1]),
        "random bit patterns": (
            noise[0],
            noise_weights[0],
            noise_rows[0],
            noise[1],
            noise_weights[1],
            noise_rows[1],
        ),
    }
    if config.quantized:
        return _check_quantized(device, cases, (batch, tokens, hidden, dtype))
    for name, (rows, w, s, u, uw, g) in cases.items():
        got = launch(rows, w, 1e-5, s, u, uw, g)
        expected = reference.sandwich(rows, w, 1e-5, s, u, uw, g)
        if not all(a is b or bits_equal(a, b) for a, b in zip(got, expected, strict=True)):
            return False, f"{name}: differs from eager"
    torch.cuda.synchronize(device)
    return True, f"{len(cases)} cases x [{batch}, {tokens}, {hidden}] {dtype}, edge rows + random bits"


def _check_quantized(device: torch.device, cases: dict[str, tuple], shape: tuple) -> tuple[bool, str]:
    """The quantizing form's verdict over the cases with a next norm: its bytes and scales against
    torchao's quantization (`float8_quant.reference`, eager's kernels) of eager's out, and its stream
    against eager's."""
    from ..float8_quant import reference as float8_reference
    from ..float8_quant.selfcheck import same

    checked = 0
    for name, (rows, w, s, u, uw, g) in cases.items():
        if w is None:
            continue
        checked += 1
        q, q_scale, stream = launch_quantized(rows, w, 1e-5, s, u, uw, g)
        out, expected_stream = reference.sandwich(rows, w, 1e-5, s, u, uw, g)
        if not (stream is expected_stream or bits_equal(stream, expected_stream)):
            return False, f"{name}, quantized: the stream differs from eager"
        if not same((q, q_scale), float8_reference.quantize(out, "row")):
            return False, f"{name}: its quantization differs from torchao's of eager's out"
    torch.cuda.synchronize(device)
    batch, tokens, hidden, dtype = shape
    return True, (
        f"{checked} quantizing cases x [{batch}, {tokens}, {hidden}] {dtype}, edge rows + random bits, "
        "against torchao's per-row float8"
    )


OP = FusedOp(
    name="sandwich_norm",
    spec=SPEC,
    self_check=self_check,
    verify_configs=tuple(
        Config(dtype, quantized=kind) for kind in (None, "row") for dtype in (torch.bfloat16, torch.float16)
    ),
    unbuilt=runtime.float8_unbuilt,
)
