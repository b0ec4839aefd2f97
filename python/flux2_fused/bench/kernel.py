"""Kernel benchmark: one fused site, eager vs fused, as % of two copy floors.

    flux2-fused kernel [--op OP] [--shapes AxT ...] [--no-compile] [--json FILE]

Sites (`--op`), the floors' bytes counted for bf16:
- gated_resnorm, shapes DxT: one gated residual + LayerNorm + adaLN site [B, T, D] with FLUX.2's
  modulation (one row a sample); the floor moves 8 bytes an element (read residual and update, write
  residual and output). FLUX.3's sites read a modulation row per token, chunks of a [B, T, 3D]
  tensor: DxT:token is that site (14 bytes: the shift, scale and gate rows read too), DxT:update2
  FLUX.3's mode block site, the two-term update `residual + gate * (update + update2)` into the norm
  (16 bytes), DxT:twin its single block's twin norms: two segments, the first 512 of the T tokens
  text, each its own two-term update and modulation rows, normalized into one joint buffer with both
  streams written in one launch (16 bytes). DxT:quant is FLUX.2's site writing torchao's per-row
  float8 of the norm for the Linears that read it (7 bytes: the output one byte an element);
  DxT:update2-quant and DxT:twin-quant are FLUX.3's sites writing it (15 bytes). DxT:update2-proven
  and DxT:twin-proven are FLUX.3's sites with its modulation as the model makes it (each batch's
  rows all its first) and uniform_rows' proofs of it, made before the timing: the kernel reads one
  modulation row a batch (10 bytes).
- qk_norm_rope, shapes HxT: one double block's attention prologue, H heads of 128, T joint tokens of
  which the first 512 are text: six projection outputs in (q, k, v of both streams), joint q, k, v
  out. Eager is diffusers' chain (RMSNorm modules, concat, RoPE, concat of v); fused is one launch
  for all of it. The floor moves 12 bytes an element of q (read six bf16 inputs, write three
  outputs). HxT:single is a single block's prologue: q and k strided chunks of the block's one wide
  projection (q, k, v and the MLP part, klein's proportions) in, joint q and k out (v is read by
  attention in place); the floor moves 8 bytes an element of q. HxT:upcast is FLUX.3's prologue:
  q and k of T rows in, the norm (a float32 weight) and RoPE in fp32, one rounding at the end, q and
  k out (8 bytes an element of q). HxT:qwen is Qwen-Image's double block prologue: the double
  block's rows and bytes, with diffusers' `RMSNorm` modules (pow/mean) and the complex rotation.
- sandwich_norm, shapes DxT: Z-Image's middle sandwich site [B, T, D]: the attention output's
  diffusers `RMSNorm`, its gated residual into the stream and the feed-forward's `RMSNorm` times its
  scale (8 bytes an element: read the stream and the update, write the stream and the output);
  DxT:first the block's first norm times its scale (4 bytes), DxT:last its last gated update (6),
  DxT:quant the middle site writing torchao's per-row float8 of the norm for the Linears that read it
  (7 bytes).
- swiglu, shapes HxT: one feed-forward activation, the [B, T, 2H] projection in (HxT:pair: Z-Image's
  two [B, T, H] projections), [B, T, H] out; the floor moves 6 bytes an output element. HxT:quant
  writes torchao's per-row float8 of it for the next Linear instead (5 bytes an element), HxT:single
  that of a single block's [attention | swiglu] row, the [B, T, H/3] attention output read too.
- gelu_tanh, shapes HxT: one FLUX.1 MLP activation (`gelu(approximate="tanh")`), [B, T, H] in and
  out; the floor moves 4 bytes an element. HxT:quant and HxT:single as for swiglu (3 bytes an
  element; the single block's attention output is H/4 wide).
- float8_quant, shapes KxT (KxT:tensor: one scale for the tensor): torchao's float8 quantization of
  a [B, T, K] Linear input, e4m3fn bytes and a scale a row out; the floor moves 3 bytes an element.
- uniform_rows, shapes WxT: the check that a [B, T, W] tensor's rows all equal their batch's first
  (FLUX.3's modulation, W = 3D, made as the model makes it, so every row is read to the end), one
  word out; eager is the reference's comparison of the bit patterns. The floor moves 2 bytes an
  element (each row read once: the check writes nothing of its size).

For each shape: the eager chain, the eager chain replayed from a CUDA graph, torch.compile of the
chain (not bit-exact; for reference), and the fused version, plain and in a CUDA graph. Medians in
us, variants interleaved; "graph" columns are per call, from a graph of 20 calls (GPU time without
launch gaps). Two floors, both measured in the same run: the site's bytes at the bandwidth of a 2 GiB
copy (`% copy BW`: a stream with no start or end, which no kernel of the site's size reaches), and one
copy of the site's bytes timed like the fused kernel (`% copy`: the same ramp and tail, the floor a
kernel of this size can reach). Inputs (and the copy's buffers) rotate over enough sets to exceed the
L2 cache, so small shapes are not timed out of cache.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from ..errors import BadValue
from ..ops import (
    bits_equal,
    float8_quant,
    gated_resnorm,
    gelu_tanh,
    qk_norm_rope,
    sandwich_norm,
    swiglu,
    uniform_rows,
)
from ..ops.qk_norm_rope.selfcheck import HEAD_DIM, rope_tables
from .options import require_at_least_one
from .results.kernel import KernelReport, KernelRow, format_kernel_table
from .results.tables import write_json
from .timing import copy_bandwidth_gbs, graphed, interleaved_median_us

DEFAULT_SHAPES = {
    "gated_resnorm": [
        "3072x512",
        "3072x4096",
        "3072x4608",
        "6144x64",
        "6144x512",
        "6144x4096",
        "6144x4608",
        "6144x8704",
        # FLUX.3 [klein] at 1024x1024: an image mode block's norm with one update and with its two
        # (text: 512 rows), the joint single block's twin norms, without and with a 4096-token reference.
        "3072x4096:token",
        "3072x512:update2",
        "3072x4096:update2",
        "3072x4608:twin",
        "3072x8704:twin",
        # FLUX.2 with torchao float8 linears per row: klein's single block norm, dev's.
        "3072x4608:quant",
        "6144x4608:quant",
        # FLUX.3 [klein]'s norm sites quantizing for float8 Linears: an image mode block, a joint block.
        "3072x4096:update2-quant",
        "3072x4608:twin-quant",
        # The mode block and the joint block with their modulation rows proven equal (uniform_rows).
        "3072x4096:update2-proven",
        "3072x4608:twin-proven",
    ],
    "qk_norm_rope": [
        "24x4608",
        "48x4608",
        "24x4608:single",
        "48x4608:single",
        "24x1536",
        "48x16896",
        # FLUX.3 [klein] at 1024x1024: its text and image mode blocks, its joint single blocks.
        "24x512:upcast",
        "24x4096:upcast",
        "24x4608:upcast",
        # Qwen-Image at 1024x1024: its 60 double blocks' prologue (512 text + 4096 image rows).
        "24x4608:qwen",
    ],
    # Z-Image-Turbo at 1024x1024: its main layers' joint rows (4096 image + 512 caption tokens).
    "sandwich_norm": ["3840x4608", "3840x4608:first", "3840x4608:last", "3840x4608:quant"],
    "swiglu": [
        "9216x4608",
        "18432x4608",
        "9216x512",
        "18432x4096",
        "10240x4608:pair",
        "9216x4096:quant",
        "9216x4608:single",
        "18432x4608:single",
        "9216x4096:quant-tensor",
        "9216x4608:single-tensor",
    ],
    # FLUX.1-dev's MLP (3072 x 4): the single block's joint rows, the image rows, the text rows; their
    # float8 forms.
    "gelu_tanh": [
        "12288x4608",
        "12288x4096",
        "12288x512",
        "12288x4096:quant",
        "12288x4608:single",
        "12288x4096:quant-tensor",
        "12288x4608:single-tensor",
    ],
    # klein-4B's Linear inputs at 1024x1024: the hidden rows, the MLP's hidden rows (per row and per
    # tensor).
    "float8_quant": ["3072x4608", "9216x4608", "3072x4608:tensor"],
    # FLUX.3 [klein] at 1024x1024: the image and text mode stacks' modulation, the joint rows'.
    "uniform_rows": ["9216x4096", "9216x512", "9216x4608"],
}
# What a --shapes item of each op looks like, and the layouts after its colon ("" for none).
SHAPE_FORMS = {
    "gated_resnorm": "DxT, DxT:token, DxT:update2, DxT:twin, DxT:quant, DxT:update2-quant, DxT:twin-quant, "
    "DxT:update2-proven or DxT:twin-proven (hidden x tokens, e.g. 6144x4608; quant: torchao's per-row "
    "float8 of the norm; proven: modulation rows proven equal)",
    "qk_norm_rope": "HxT, HxT:single, HxT:upcast or HxT:qwen (heads x joint tokens, e.g. 24x4608)",
    "sandwich_norm": "DxT, DxT:first, DxT:last or DxT:quant (hidden x tokens, e.g. 3840x4608; quant: "
    "torchao's per-row float8 of the next norm)",
    "swiglu": "HxT, HxT:pair, HxT:quant, HxT:single, HxT:quant-tensor or HxT:single-tensor (hidden x "
    "tokens, e.g. 9216x4608; pair: a and b two tensors; quant: the float8 of it for the next Linear; "
    "single: of [attention | swiglu]; -tensor: with one scale for the tensor)",
    "gelu_tanh": "HxT, HxT:quant, HxT:single, HxT:quant-tensor or HxT:single-tensor (hidden x tokens, e.g. "
    "12288x4608; quant: the float8 of it for the next Linear; single: of [attention | gelu]; -tensor: "
    "with one scale for the tensor)",
    "float8_quant": "KxT or KxT:tensor (row width x rows, e.g. 3072x4608; tensor: one scale)",
    "uniform_rows": "WxT (row width x rows, e.g. 9216x4096)",
}
LAYOUTS = {
    "gated_resnorm": (
        "",
        "token",
        "update2",
        "twin",
        "quant",
        "update2-quant",
        "twin-quant",
        "update2-proven",
        "twin-proven",
    ),
    "qk_norm_rope": ("", "single", "upcast", "qwen"),
    "sandwich_norm": ("", "first", "last", "quant"),
    "swiglu": ("", "pair", "quant", "single", "quant-tensor", "single-tensor"),
    "gelu_tanh": ("", "quant", "single", "quant-tensor", "single-tensor"),
    "float8_quant": ("", "tensor"),
    "uniform_rows": ("",),
}
L2_FLUSH_BYTES = 256 << 20
GRAPH_REPEATS = 20
TEXT_TOKENS = 512
EPS = 1e-6  # the norms' eps in every family


@dataclass
class Case:
    """One site to time: input sets, the eager chain and the fused version over one set, and the
    bytes the floor moves."""

    sets: list[tuple]
    eager: Callable[..., object]
    fused: Callable[..., object]
    floor_bytes: int
    width: int  # D of the row: the hidden size, or heads x 128
    label: str = ""  # the row's op column when it is not the op's name (a variant of the site)


def _outputs(result: object) -> Sequence[torch.Tensor | None]:
    return result if isinstance(result, tuple | list) else [result]


def _same(got: torch.Tensor | None, ref: torch.Tensor | None) -> bool:
    """Bit equality of one output, where an output a site does not produce is None on both sides
    (sandwich_norm's last site has no next norm)."""
    if got is None or ref is None:
        return got is None and ref is None
    if got.dtype == torch.float8_e4m3fn:  # bytes: NaN is one pattern here, and isnan is not defined
        return ref.dtype == got.dtype and torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    return bits_equal(got, ref)


def _sets(make: Callable[[], tuple], bytes_per_set: int) -> list[tuple]:
    return [make() for _ in range(max(1, min(16, -(-L2_FLUSH_BYTES // bytes_per_set))))]


def _check_layout(op: str, layout: str) -> None:
    """ValueError for a layout `op` does not have (a caller past `parse_shape`, which says it in one line)."""
    if layout not in LAYOUTS[op]:
        raise ValueError(f"unknown {op} layout {layout!r} ({SHAPE_FORMS[op]})")


def gated_resnorm_case(width: int, tokens: int, batch: int, dtype: torch.dtype, layout: str = "") -> Case:
    """One gated residual + modulated norm site [B, T, D]: FLUX.2's (layout ""), one modulation row a
    sample (the second triple of a [B, 1, 6D] tensor's chunks); FLUX.3's (see the module docstring),
    modulation rows per token (chunks of a [B, T, 3D] tensor), "update2" and "twin" with two-term
    updates, "twin" over two segments (text first) each with its own rows. One segment runs the
    validated op against the reference; the twin norms `gated_resnorm.fused` (the guards, then the
    launch) against `reference.segments`, both giving the joint norm and the joint stream. A layout
    ending in "quant" is the site's quantizing form, `gated_resnorm.quantized` against the reference
    then torchao's per-row quantization of its out (eager's kernels), both giving (bytes, scales,
    stream)."""
    _check_layout("gated_resnorm", layout)
    quant = layout.endswith("quant")
    proven = layout.endswith("proven")
    base = layout.removesuffix("quant").removesuffix("proven").removesuffix("-")
    twin = base == "twin"
    txt = min(TEXT_TOKENS, tokens - 1) if twin else 0
    sizes = (txt, tokens - txt) if twin else (tokens,)
    two_terms = base in ("update2", "twin")

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=dtype)

    proofs: dict[int, uniform_rows.UniformRows | None] = {}  # by the shift chunk's address

    def segment(rows: int) -> tuple:
        """(residual, update, gate, scale, shift[, update2]) of `rows` tokens."""
        if proven:  # FLUX.3's modulation as the model makes it, and its proof
            mod = randn(batch, 1, 3 * width).expand(batch, rows, 3 * width).contiguous()
            shift, scale, gate = mod.chunk(3, dim=-1)
            proofs[shift.data_ptr()] = uniform_rows.check(mod)
        elif base:  # FLUX.3: per token, diffusers' (shift, scale, gate) chunks
            shift, scale, gate = randn(batch, rows, 3 * width).chunk(3, dim=-1)
        else:  # FLUX.2: the MLP's (shift, scale, gate), a row a sample
            shift, scale, gate = randn(batch, 1, 6 * width).chunk(6, dim=-1)[3:]
        residual, update = randn(batch, rows, width), randn(batch, rows, width)
        return residual, update, gate, scale, shift, *([randn(batch, rows, width)] if two_terms else [])

    def make() -> tuple:
        return tuple(t for rows in sizes for t in segment(rows))

    def site(
        args: tuple,
    ) -> tuple[list[gated_resnorm.Segment], gated_resnorm.Modulation, gated_resnorm.Modulation]:
        """A set as the launch takes it: the segments, and scale and shift (a tuple of one per
        segment for the twin norms)."""
        n = len(args) // len(sizes)
        parts = [args[i : i + n] for i in range(0, len(args), n)]
        rows = [
            gated_resnorm.Segment(
                *p[:3], update2=p[5] if two_terms else None, gate_rows=proofs.get(p[4].data_ptr())
            )
            for p in parts
        ]
        if not twin:
            return rows, parts[0][3], parts[0][4]
        return rows, tuple(p[3] for p in parts), tuple(p[4] for p in parts)

    if quant:

        def eager(*args: torch.Tensor) -> tuple:
            out, stream = gated_resnorm.reference.segments(*site(args), EPS)
            return (*float8_quant.reference.quantize(out, "row"), stream)

        def fused(*args: torch.Tensor) -> object:
            return gated_resnorm.quantized(*site(args), EPS, write_residual=True)

    elif twin or proven:

        def eager(*args: torch.Tensor) -> tuple:
            return gated_resnorm.reference.segments(*site(args), EPS)

        def fused(*args: torch.Tensor) -> object:
            rows, scale, shift = site(args)
            mod_rows = (
                tuple(proofs.get(t.data_ptr()) for t in shift) if twin else proofs.get(shift.data_ptr())
            )
            return gated_resnorm.fused(rows, scale, shift, EPS, write_residual=True, mod_rows=mod_rows)

    else:  # (residual, update, gate, scale, shift[, update2])

        def eager(*args: torch.Tensor) -> tuple:
            return gated_resnorm.gated_resnorm_reference(*args[:5], EPS, *args[5:])

        def fused(*args: torch.Tensor) -> tuple:
            return gated_resnorm.gated_resnorm(*args[:5], EPS, update2=args[5] if two_terms else None)

    elements = batch * tokens * width
    # Read residual and update(s), write residual and output; per-token rows read three more (proven
    # ones one row a batch, from cache); the quantizing form writes the output one byte an element.
    values = 4 + 3 * (bool(base) and not proven) + two_terms - quant
    floor_bytes = (values * dtype.itemsize + quant) * elements
    sets = _sets(make, floor_bytes)
    reason = (gated_resnorm.quantized_reason if quant else gated_resnorm.decline_reason)(*site(sets[0]))
    if reason is not None:
        raise RuntimeError(f"fused path declined D={width} T={tokens} {layout or 'flux2'}: {reason}")
    return Case(sets, eager, fused, floor_bytes, width, f"gated_resnorm {layout}".strip())


def qk_norm_rope_case(heads: int, tokens: int, batch: int, dtype: torch.dtype, layout: str = "") -> Case:
    """A double block's prologue: q, k, v of text (512 rows) and image rows, four RMSNorm weights; or
    (layout "single") a single block's: q and k chunks of one wide projection, two weights; or
    (layout "upcast") FLUX.3's: q and k of one projection each, two float32 weights, norm and RoPE in
    fp32 (v, attention's as the projection gave it, not part of the site); or (layout "qwen")
    Qwen-Image's: a double block's rows with diffusers' RMSNorm and the complex rotation."""
    _check_layout("qk_norm_rope", layout)
    single, upcast, double = layout == "single", layout == "upcast", layout in ("", "qwen")
    mode = {"upcast": upcast, **({"rotation": "complex", "norm": "mean"} if layout == "qwen" else {})}
    txt = min(TEXT_TOKENS, tokens - 1) if double else 0
    sizes = (txt, tokens - txt) if double else (tokens,)
    width = heads * HEAD_DIM
    gen = torch.Generator(device="cuda").manual_seed(0)
    if layout == "qwen":
        angles = torch.rand(tokens, HEAD_DIM // 2, device="cuda", generator=gen, dtype=torch.float64) * 4096
        freqs = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
        cos, sin = qk_norm_rope.reference.complex_tables(freqs)
    else:
        cos, sin = rope_tables(tokens, torch.device("cuda"), gen)
    weight_dtype = torch.float32 if upcast else dtype

    def weights() -> list[torch.Tensor]:
        return [torch.randn(HEAD_DIM, device="cuda", dtype=weight_dtype) for _ in sizes]

    def projection(rows: int) -> torch.Tensor:
        return torch.randn(batch, rows, width, device="cuda", dtype=dtype).unflatten(-1, (heads, HEAD_DIM))

    def make() -> tuple:
        if single:  # q, k, v, then the MLP part (2 x 3 D wide), as klein's to_qkv_mlp_proj
            wide = torch.randn(batch, tokens, 9 * width, device="cuda", dtype=dtype)
            q, k = (t.unflatten(-1, (heads, HEAD_DIM)) for t in wide.split(width, dim=-1)[:2])
            return [q], [k], None, weights(), weights()
        q, k = ([projection(rows) for rows in sizes] for _ in range(2))
        v = None if upcast else [projection(rows) for rows in sizes]
        return q, k, v, weights(), weights()

    def segments(args: tuple) -> tuple[list, list, list | None]:
        q, k, v, q_weights, k_weights = args
        segment = qk_norm_rope.Segment
        q_rows = [segment(x, w) for x, w in zip(q, q_weights, strict=True)]
        return q_rows, [segment(x, w) for x, w in zip(k, k_weights, strict=True)], v

    outputs = 3 if double else 2  # q, k, and a double block's joint v

    def eager(*args: object) -> tuple:
        q, k, v = segments(args)
        return qk_norm_rope.reference.prologue(q, k, cos, sin, EPS, v, **mode)[:outputs]

    def fused(*args: object) -> tuple:
        q, k, v = segments(args)
        return qk_norm_rope.qk_norm_rope(q, k, cos, sin, EPS, v, **mode)[:outputs]

    floor_bytes = (6 if double else 4) * batch * tokens * width * dtype.itemsize
    sets = _sets(make, floor_bytes)
    q, k, v = segments(sets[0])
    if qk_norm_rope.decline_reason(q, k, cos, sin, v, **mode) is not None:
        raise RuntimeError(f"fused path declined H={heads} T={tokens} {layout or 'double'}")
    return Case(sets, eager, fused, floor_bytes, width, f"qk_norm_rope {layout}".strip())


def sandwich_norm_case(width: int, tokens: int, batch: int, dtype: torch.dtype, layout: str = "") -> Case:
    """One of Z-Image's sandwich sites [B, T, D] (see the module docstring): the middle one (layout
    ""), the block's first norm ("first") or its last update ("last"), gates and scales one row a
    sample, eps 1e-5; "quant" the middle one's quantizing form, `sandwich_norm.quantized` against
    the reference then torchao's per-row quantization of its out (eager's kernels)."""
    _check_layout("sandwich_norm", layout)

    def rows(std: float = 1.0) -> torch.Tensor:
        return (torch.randn(batch, tokens, width, device="cuda") * std).to(dtype)

    def vector() -> torch.Tensor:
        return torch.randn(width, device="cuda").to(dtype)

    def batch_rows() -> torch.Tensor:
        return torch.randn(batch, 1, width, device="cuda").to(dtype)

    def make() -> tuple:
        x, weight, scale = rows(), vector(), batch_rows()
        if layout == "first":
            return (x, weight, 1e-5, scale)
        update, update_weight, gate = rows(4.0), vector(), batch_rows().tanh()
        if layout == "last":
            return (x, None, 1e-5, None, update, update_weight, gate)
        return (x, weight, 1e-5, scale, update, update_weight, gate)

    elements = batch * tokens * width
    # Elements of T read and written (the middle site: x and the update in, the stream and out); the
    # quantizing form writes out one byte an element.
    values = {"": 4, "first": 2, "last": 3, "quant": 3}[layout]
    floor_bytes = (values * dtype.itemsize + (layout == "quant")) * elements
    sets = _sets(make, floor_bytes)
    if layout == "quant":

        def eager(*args: object) -> tuple:
            out, stream = sandwich_norm.reference.sandwich(*args)
            return (*float8_quant.reference.quantize(out, "row"), stream)

        fused, reason = sandwich_norm.quantized, sandwich_norm.quantized_reason(*sets[0])
    else:
        eager, fused = sandwich_norm.reference.sandwich, sandwich_norm.sandwich_norm
        reason = sandwich_norm.decline_reason(*sets[0])
    if reason is not None:
        raise RuntimeError(f"fused path declined D={width} T={tokens} {layout or 'middle'}: {reason}")
    return Case(sets, eager, fused, floor_bytes, width, f"sandwich_norm {layout}".strip())


def swiglu_case(hidden: int, tokens: int, batch: int, dtype: torch.dtype, layout: str = "") -> Case:
    """One feed-forward activation: the [B, T, 2H] projection in (layout ""), or Z-Image's two
    [B, T, H] projections ("pair"), [B, T, H] out; "quant" and "single" (with "-tensor": one scale for
    the tensor) its quantizing form."""
    _check_layout("swiglu", layout)
    if layout not in ("", "pair"):
        return _quantized_case("swiglu", hidden, tokens, batch, dtype, layout)
    width = hidden if layout == "pair" else 2 * hidden

    def make() -> tuple:
        x = torch.randn(batch, tokens, width, device="cuda", dtype=dtype) * 4
        return (x, torch.randn_like(x)) if layout == "pair" else (x,)

    elements = batch * tokens * hidden
    sets = _sets(make, 3 * elements * dtype.itemsize)
    if swiglu.decline_reason(sets[0][0], None, *sets[0][1:]) is not None:
        raise RuntimeError(f"fused path declined H={hidden} T={tokens} {layout}")
    fused = swiglu.swiglu if layout != "pair" else lambda a, b: swiglu.swiglu(a, None, b)
    label = f"swiglu {layout}".strip()
    return Case(sets, swiglu.reference.swiglu, fused, 3 * elements * dtype.itemsize, hidden, label)


# A quantizing row-wise op: its package, the operands a row of its input holds, and its width over
# the attention output's in a single block's [attention | activation] row (FLUX.2's MLP ratio 3,
# FLUX.1's 4).
_QUANTIZING = {"swiglu": (swiglu, 2, 3), "gelu_tanh": (gelu_tanh, 1, 4)}


def _quantized_case(name: str, hidden: int, tokens: int, batch: int, dtype: torch.dtype, layout: str) -> Case:
    """A row-wise op's quantizing form: [B, T, operands x H] in (after a single block's attention
    output for "single"), torchao's float8 of the row out (a scale a row, or one for the tensor with
    "-tensor": the joint rows and their words written, then read again, bytes the floor counts); the
    eager chain is the activation, the cat, then torchao's quantization."""
    op, operands, ratio = _QUANTIZING[name]
    shape, _, kind = layout.partition("-")
    granularity = kind or "row"
    dim = hidden // ratio if shape == "single" else 0

    def make() -> tuple:
        x = torch.randn(batch, tokens, operands * hidden, device="cuda", dtype=dtype) * 4
        return (x, torch.randn(batch, tokens, dim, device="cuda", dtype=dtype) if dim else None)

    def eager(x: torch.Tensor, prefix: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        value = getattr(op.reference, name)(x)
        joint = value if prefix is None else torch.cat([prefix, value], -1)
        return float8_quant.reference.quantize(joint, granularity)

    def fused(x: torch.Tensor, prefix: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        out = op.quantized(x, prefix=prefix, granularity=granularity)
        if out is None:
            raise RuntimeError(f"quantizing {name} declined H={hidden} T={tokens} {layout}")
        return out

    rows = batch * tokens
    floor_bytes = rows * (hidden * (operands * dtype.itemsize + 1) + dim * (dtype.itemsize + 1))
    if granularity == "tensor":  # the joint rows are also written, then read again
        floor_bytes += 2 * rows * (hidden + dim) * dtype.itemsize
    return Case(_sets(make, floor_bytes), eager, fused, floor_bytes, hidden, f"{name} {layout}")


def gelu_tanh_case(hidden: int, tokens: int, batch: int, dtype: torch.dtype, layout: str = "") -> Case:
    """One FLUX.1 MLP activation: the [B, T, H] projection in, [B, T, H] out; "quant" and "single"
    (with "-tensor": one scale for the tensor) its quantizing form."""
    _check_layout("gelu_tanh", layout)
    if layout:
        return _quantized_case("gelu_tanh", hidden, tokens, batch, dtype, layout)

    def make() -> tuple:
        return (torch.randn(batch, tokens, hidden, device="cuda", dtype=dtype) * 4,)

    elements = batch * tokens * hidden
    sets = _sets(make, 2 * elements * dtype.itemsize)
    if gelu_tanh.decline_reason(*sets[0]) is not None:
        raise RuntimeError(f"fused path declined H={hidden} T={tokens}")
    return Case(
        sets, gelu_tanh.reference.gelu_tanh, gelu_tanh.gelu_tanh, 2 * elements * dtype.itemsize, hidden
    )


def float8_quant_case(cols: int, tokens: int, batch: int, dtype: torch.dtype, layout: str = "") -> Case:
    """One torchao float8 activation quantization: [B, T, K] in, its e4m3fn bytes and scales out (a
    scale a row, or one for the tensor with layout "tensor")."""
    _check_layout("float8_quant", layout)
    granularity = layout or "row"

    def make() -> tuple:
        return ((torch.randn(batch, tokens, cols, device="cuda") * 4).to(dtype), granularity)

    elements = batch * tokens * cols
    floor_bytes = elements * (dtype.itemsize + 1)
    sets = _sets(make, floor_bytes)
    if float8_quant.decline_reason(*sets[0]) is not None:
        raise RuntimeError(f"fused path declined K={cols} T={tokens} {granularity}")
    label = f"float8_quant {layout}".strip()
    return Case(sets, float8_quant.reference.quantize, float8_quant.float8_quant, floor_bytes, cols, label)


def uniform_rows_case(width: int, tokens: int, batch: int, dtype: torch.dtype) -> Case:
    """One modulation check: [B, T, W] rows, each batch's rows its first (the check reads them all)."""

    def make() -> tuple:
        return (
            torch.randn(batch, 1, width, device="cuda").to(dtype).expand(batch, tokens, width).contiguous(),
        )

    floor_bytes = batch * tokens * width * dtype.itemsize
    sets = _sets(make, floor_bytes)
    if uniform_rows.decline_reason(*sets[0]) is not None:
        raise RuntimeError(f"fused path declined W={width} T={tokens}")
    return Case(sets, uniform_rows.reference.differs, uniform_rows.uniform_rows, floor_bytes, width)


CASES = {
    "gated_resnorm": gated_resnorm_case,
    "qk_norm_rope": qk_norm_rope_case,
    "sandwich_norm": sandwich_norm_case,
    "swiglu": swiglu_case,
    "gelu_tanh": gelu_tanh_case,
    "float8_quant": float8_quant_case,
    "uniform_rows": uniform_rows_case,
}


def _rotating(fn, sets):
    """A callable that runs `fn` on the next input set each call."""
    state = {"i": 0}

    def call():
        args = sets[state["i"] % len(sets)]
        state["i"] += 1
        return fn(*args)

    return call


def _same_bytes_copy(floor_bytes: int) -> Callable[[], object]:
    """A device copy that reads and writes `floor_bytes` in all, rotating over buffers like the
    inputs (so it is not timed out of the L2 cache): the floor as one kernel of the site's size."""

    def make() -> tuple:
        src = torch.empty(floor_bytes // 2, dtype=torch.uint8, device="cuda").random_()
        return src, torch.empty_like(src)

    return _rotating(lambda src, dst: dst.copy_(src), _sets(make, floor_bytes))


def bench_case(op: str, case: Case, tokens: int, batch: int, copy_gbs: float, compiled) -> KernelRow:
    """Time one case: eager and fused, plain and in CUDA graphs, and torch.compile of the eager chain."""
    exact = all(
        _same(got, ref)
        for got, ref in zip(
            _outputs(case.fused(*case.sets[0])), _outputs(case.eager(*case.sets[0])), strict=True
        )
    )
    fns = [
        _rotating(case.eager, case.sets),
        graphed(_rotating(case.eager, case.sets), GRAPH_REPEATS),
        _rotating(case.fused, case.sets),
        graphed(_rotating(case.fused, case.sets), GRAPH_REPEATS),
        graphed(_same_bytes_copy(case.floor_bytes), GRAPH_REPEATS),
    ]
    if compiled is not None:
        fns.append(_rotating(compiled, case.sets))
    times = interleaved_median_us(fns)
    for graph in (1, 3, 4):
        times[graph] /= GRAPH_REPEATS
    floor_us = case.floor_bytes / (copy_gbs * 1e3)
    return KernelRow(
        op=op,
        dim=case.width,
        tokens=tokens,
        batch=batch,
        eager_us=times[0],
        eager_graph_us=times[1],
        compile_us=times[5] if compiled is not None else None,
        fused_us=times[2],
        fused_graph_us=times[3],
        floor_us=floor_us,
        pct_of_copy_bw=100 * floor_us / times[3],
        copy_graph_us=times[4],
        pct_of_copy=100 * times[4] / times[3],
        speedup_vs_eager=times[0] / times[2],
        speedup_vs_graph=times[1] / times[3],
        bit_exact=exact,
    )


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_shape(op: str, item: str) -> tuple[int, int, str]:
    """A --shapes item of `op` as (size, tokens, layout): DxT or HxT, with the op's LAYOUTS after a
    colon (gated_resnorm DxT:twin, qk_norm_rope HxT:single, ...); BadValue (exit status 2) naming the
    item and the form it should have."""
    shape, _, layout = item.lower().partition(":")
    size, _, tokens = shape.partition("x")
    whole = size.isdigit() and tokens.isdigit() and int(size) > 0 and int(tokens) > 0
    if not whole or layout not in LAYOUTS[op]:
        raise BadValue(f"--shapes {item!r}: --op {op} takes {SHAPE_FORMS[op]}, whole numbers of at least 1")
    return int(size), int(tokens), layout


def check(args: argparse.Namespace) -> None:
    """Refuse, before any work, values the run cannot use (BadValue: one line, exit status 2); --json
    is checked as it is parsed (`options.OutputFile`)."""
    require_at_least_one({"--batch": args.batch})
    for item in args.shapes or ():
        parse_shape(args.op, item)


def run(args: argparse.Namespace) -> int:
    """Benchmark every shape on the current CUDA GPU and print the table; 1 when a shape's fused
    outputs differ from eager's. `check(args)` has passed."""
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for item in args.shapes or DEFAULT_SHAPES[args.op]:
        size, tokens, layout = parse_shape(args.op, item)
        case = CASES[args.op](size, tokens, args.batch, DTYPES[args.dtype], *([layout] if layout else []))
        compiled = None if args.no_compile else torch.compile(case.eager, dynamic=False)
        rows.append(bench_case(case.label or args.op, case, tokens, args.batch, copy_gbs, compiled))
        print(
            f"{args.op} {item}: fused {rows[-1].fused_graph_us:.1f} us in a graph "
            f"({rows[-1].pct_of_copy_bw:.0f}% of copy BW, {rows[-1].pct_of_copy:.0f}% of a copy of its "
            "bytes)",
            file=sys.stderr,
        )
    report = KernelReport(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_gbs=copy_gbs, rows=rows
    )
    print(format_kernel_table(report))
    if args.json:
        write_json(asdict(report), args.json)
    return 0 if all(r.bit_exact for r in rows) else 1
