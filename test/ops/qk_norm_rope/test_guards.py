"""CPU tests of the qk_norm_rope guards and entry point: every decline reason with its message (q/k
segments, v segments, what one launch needs across them), in FLUX.2's mode and the upcast mode
(FLUX.3), the validated op's errors, garbage that never raises, and the entry point's fallback on
the CPU."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from flux2_fused.ops import qk_norm_rope, runtime, verdicts
from flux2_fused.ops.qk_norm_rope import (
    HEAD_DIM,
    OP,
    Config,
    Segment,
    decline_reason,
    guards,
    segment_decline_reason,
    value_decline_reason,
)
from flux2_fused.ops.verdicts import TypeReason

from ..conftest import as_cuda, misaligned, reason_templates, untested

B, S, H = 2, 5, 3
BF16 = torch.bfloat16
F32 = torch.float32


def _x(tokens: int = S, *, dtype: torch.dtype = BF16, cuda: bool = True, width: int = H * HEAD_DIM) -> Any:
    x = torch.zeros(B, tokens, width, dtype=dtype).unflatten(-1, (-1, HEAD_DIM))
    return as_cuda(x) if cuda else x


def _table(tokens: int = S, dtype: torch.dtype = torch.float32) -> Any:
    return as_cuda(torch.zeros(tokens, HEAD_DIM, dtype=dtype))


def _args(**overrides: Any) -> tuple[Any, ...]:
    args = {"x": _x(), "weight": as_cuda(torch.zeros(HEAD_DIM, dtype=BF16)), "cos": _table(), "sin": _table()}
    args.update(overrides)
    return tuple(args.values())


CASES: dict[str, tuple[tuple[Any, ...], str]] = {
    "x not a tensor": (_args(x=1.0), "x is not a tensor"),
    "x 3-D": (
        _args(x=as_cuda(torch.zeros(B, S, HEAD_DIM, dtype=BF16))),
        "x must be [B, S, H, head_dim], got (2, 5, 128)",
    ),
    "head_dim 64": (
        _args(x=as_cuda(torch.zeros(B, S, H, 64, dtype=BF16))),
        "head_dim 64 is not 128 (the kernel reproduces aten's reduction for 128)",
    ),
    "heads not dense": (
        _args(x=as_cuda(torch.zeros(B, S, H, 2 * HEAD_DIM, dtype=BF16))[..., :HEAD_DIM]),
        "x heads are not dense (needs strides (..., 128, 1))",
    ),
    "row stride": (
        _args(
            x=as_cuda(torch.zeros(B, S, H * HEAD_DIM + 2, dtype=BF16))[..., 2:].unflatten(-1, (-1, HEAD_DIM))
        ),
        "x row stride 386 is not a multiple of 8 elements",
    ),
    "batch stride": (
        _args(
            x=as_cuda(
                torch.zeros(B * S * H * HEAD_DIM + 2, dtype=BF16).as_strided(
                    (B, S, H, HEAD_DIM), (S * H * HEAD_DIM + 2, H * HEAD_DIM, HEAD_DIM, 1)
                )
            )
        ),
        f"x batch stride {S * H * HEAD_DIM + 2} is not a multiple of 8 elements",
    ),
    "cos not a tensor": (_args(cos=None), "cos is not a tensor"),
    "cos bf16": (_args(cos=_table(dtype=BF16)), "cos is torch.bfloat16, the RoPE tables are float32"),
    "sin shape": (
        _args(sin=as_cuda(torch.zeros(S, 64))),
        "sin must be a contiguous [S, 128] or [B, S, 128] table, got (5, 64)",
    ),
    "table batch rows": (
        _args(sin=as_cuda(torch.zeros(3, S, HEAD_DIM))),
        "sin has 3 batch rows, x 2",
    ),
    "weight not a tensor": (_args(weight=[1.0]), "weight is not a tensor"),
    "weight shape": (
        _args(weight=as_cuda(torch.zeros(64, dtype=BF16))),
        "weight must be a dense [128] vector, got (64,)",
    ),
    "cpu": (_args(x=_x(cuda=False)), "x is on cpu, the fused kernel needs CUDA"),
    "float32": (
        _args(x=_x(dtype=torch.float32), weight=as_cuda(torch.zeros(HEAD_DIM))),
        "dtype torch.float32 is not supported (bfloat16, float16)",
    ),
    "weight dtype": (
        _args(weight=as_cuda(torch.zeros(HEAD_DIM, dtype=torch.float16))),
        "weight is torch.float16, x is torch.bfloat16 (eager would promote)",
    ),
    "float32 weight outside the upcast mode": (
        _args(weight=as_cuda(torch.zeros(HEAD_DIM, dtype=F32))),
        "weight is torch.float32, x is torch.bfloat16 (eager would promote)",
    ),
    "weight device": (
        _args(weight=as_cuda(torch.zeros(HEAD_DIM, dtype=BF16), 1)),
        "weight is on cuda:1, x on cuda:0",
    ),
    "tables differ": (_args(sin=_table(S + 1)), "cos (5, 128) and sin (6, 128) differ"),
    "grad": (
        _args(x=as_cuda(torch.zeros(B, S, H, HEAD_DIM, dtype=BF16).requires_grad_())),
        "x requires grad and the fused kernel has no backward",
    ),
    "misaligned": (
        _args(x=as_cuda(misaligned(B, S, H, HEAD_DIM))),
        "x data pointer is not 16-byte aligned",
    ),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.usefixtures("accept_runtime")
def test_decline_reason(name: str) -> None:
    """The exact reason; the guard says False; the validated op raises TypeError or ValueError with it."""
    args, expected = CASES[name]
    reason = segment_decline_reason(*args)
    assert reason == expected
    assert guards.segment(*args) is False
    error = TypeError if isinstance(reason, TypeReason) else ValueError
    with pytest.raises(error, match=f"^{re.escape('flux2-fused: ' + reason)}$"):
        rows = [Segment(args[0], args[1])]
        qk_norm_rope.qk_norm_rope(rows, rows, *args[2:])


V_CASES: dict[str, tuple[Any, str]] = {
    "v not a tensor": (None, "v is not a tensor"),
    "v heads not dense": (
        as_cuda(torch.zeros(B, S, H, 2 * HEAD_DIM, dtype=BF16))[..., :HEAD_DIM],
        "v heads are not dense (needs strides (..., 128, 1))",
    ),
    "v cpu": (_x(cuda=False), "v is on cpu, the fused kernel needs CUDA"),
    "v misaligned": (as_cuda(misaligned(B, S, H, HEAD_DIM)), "v data pointer is not 16-byte aligned"),
}


@pytest.mark.parametrize("name", V_CASES)
@pytest.mark.usefixtures("accept_runtime")
def test_value_decline_reason(name: str) -> None:
    """A v segment the kernel cannot copy: the reason, the guard, the entry point and the validated op."""
    v, expected = V_CASES[name]
    assert value_decline_reason(v) == expected
    assert guards.value(v) is False
    rows, cos, sin = [Segment(_x(), _args()[1])], _table(), _table()
    assert decline_reason(rows, rows, cos, sin, [v]) == expected
    assert qk_norm_rope.fused(rows, rows, cos, sin, 1e-6, [v]) is None
    with pytest.raises((TypeError, ValueError), match=f"^{re.escape('flux2-fused: ' + expected)}$"):
        qk_norm_rope.qk_norm_rope(rows, rows, cos, sin, v=[v])


@pytest.mark.usefixtures("accept_runtime")
def test_accepts_both_flux2_layouts() -> None:
    weight, cos, sin = _args()[1:]
    dense = _x()
    wide = as_cuda(_x(width=5 * H * HEAD_DIM, cuda=False)[:, :, H : 2 * H])  # the single block's k chunk
    for x in (dense, wide):
        assert segment_decline_reason(x, weight, cos, sin) is None and guards.segment(x, weight, cos, sin)
    txt = _x(2)
    joint = (_table(S + 2), _table(S + 2))
    rows = [Segment(txt, weight), Segment(dense, weight)]
    assert decline_reason(rows, rows, *joint, [_x(2), _x()]) is None
    assert decline_reason([Segment(dense, weight)], [Segment(wide, weight)], cos, sin) is None


def _layout(kind: str) -> tuple[list, list, Any, Any, list | None]:
    """(q, k, cos, sin, v) that one launch cannot take, each segment acceptable on its own."""
    weight, cos, sin = _args()[1:]
    one = [Segment(_x(), weight)]
    two = [Segment(_x(), weight), Segment(_x(), weight)]
    joint = _table(2 * S), _table(2 * S)
    return {
        "three segments": (one * 3, one * 3, cos, sin, None),
        "segment counts": (two, one, *joint, None),
        "heads differ": (two, [two[0], Segment(_x(width=2 * HEAD_DIM), weight)], *joint, None),
        "tokens differ": (two, two, *joint, [_x(), _x(S - 1)]),
        "dtype differs": (two, two, *joint, [_x(), _x(dtype=torch.float16)]),
        "table rows": (two, two, cos, sin, None),
    }[kind]


LAYOUT_CASES = {
    "three segments": "a launch takes one or two segments, got 3",
    "segment counts": "q, k and v have different numbers of segments",
    "heads differ": "the segments differ in batch or heads",
    "tokens differ": "q, k and v segments differ in tokens",
    "dtype differs": "the segments differ in dtype or device",
    "table rows": "the RoPE tables have 5 rows, the segments 10 tokens",
}


@pytest.mark.parametrize("kind", LAYOUT_CASES)
@pytest.mark.usefixtures("accept_runtime")
def test_entry_point_declines_what_one_launch_cannot_do(kind: str) -> None:
    q, k, cos, sin, v = _layout(kind)
    expected = LAYOUT_CASES[kind]
    assert decline_reason(q, k, cos, sin, v) == expected
    assert qk_norm_rope.fused(q, k, cos, sin, 1e-6, v) is None
    with pytest.raises(ValueError, match=f"^{re.escape('flux2-fused: ' + expected)}$"):
        qk_norm_rope.qk_norm_rope(q, k, cos, sin, v=v)


GARBAGE = {"None": None, "int": 0, "str": "x", "0-d": torch.tensor(1.0), "5-d": torch.zeros(1, 1, 1, 1, 128)}


@pytest.mark.parametrize("garbage", GARBAGE)
@pytest.mark.usefixtures("accept_runtime")
def test_guard_returns_false_for_garbage(garbage: str) -> None:
    for position in range(4):
        args = list(_args())
        args[position] = GARBAGE[garbage]
        assert guards.segment(*args) is False
        assert segment_decline_reason(*args) is not None


def test_guard_never_raises_even_when_checking_does(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> str | None:
        raise RuntimeError("bug in a check")

    monkeypatch.setattr(guards, "_metadata_reason", broken)
    monkeypatch.setattr(verdicts, "_verdicts", {})
    assert guards.segment(*_args()) is False


def test_runtime_stage_is_keyed_by_this_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """A verdict of another op for the same device never answers for this one."""
    monkeypatch.setattr(runtime, "_records", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(
        runtime, "_check", lambda op, device, config: runtime.CheckRecord(op.name != "qk_norm_rope", "x", 0)
    )
    assert guards.segment.runtime(_x()) == "self-check failed: x"
    assert [key[0] for key in runtime._records] == ["qk_norm_rope"]


@pytest.mark.parametrize("with_v", [False, True])
def test_apply_on_the_cpu_is_the_eager_chain(with_v: bool) -> None:
    norm = torch.nn.RMSNorm(HEAD_DIM, eps=1e-6)
    x = torch.randn(B, S, H, HEAD_DIM)
    cos, sin = torch.rand(2 * S, HEAD_DIM), torch.rand(2 * S, HEAD_DIM)
    q = [Segment(x, norm.weight), Segment(x.flip(1), norm.weight)]
    k = [Segment(x * 2, norm.weight), Segment(x.flip(2), norm.weight)]
    v = [x + 1, x - 1] if with_v else None
    assert qk_norm_rope.fused(q, k, cos, sin, 1e-6, v) is None
    with torch.no_grad():
        got = qk_norm_rope.apply(q, k, cos, sin, 1e-6, v)
    assert torch.equal(got[0], qk_norm_rope.reference.qk_norm_rope(q, cos, sin, 1e-6))
    assert torch.equal(got[1], qk_norm_rope.reference.qk_norm_rope(k, cos, sin, 1e-6))
    assert torch.equal(got[2], torch.cat(v, dim=1)) if with_v else got[2] is None


def test_every_decline_reason_has_a_case() -> None:
    produced = [reason for _, reason in CASES.values()] + list(LAYOUT_CASES.values())
    produced += [reason for _, reason in V_CASES.values()]
    produced += [reason for _, reason in UPCAST_CASES.values()]
    produced += [reason for _, reason in MODE_CASES.values()]
    produced += [FEW_ROWS]
    templates = reason_templates(guards, qk_norm_rope)
    assert len(templates) >= 15
    missing = untested(templates, produced)
    assert not missing, f"decline reasons without a test case: {missing}"


# The upcast mode (FLUX.3): the same checks with a float32 weight, which must be 16-byte aligned
# (aten's float RMSNorm kernel loads four floats at a time; 8 bytes would run its other reduction).


def _upcast_weight(weight: Any) -> Any:
    """A FLUX.2 case's bf16 [128] weight as the upcast mode's float32 one, on the same device; any
    other weight (the case's subject) as it is."""
    if isinstance(weight, torch.Tensor) and weight.dtype == BF16 and weight.shape == (HEAD_DIM,):
        return as_cuda(
            torch.zeros(HEAD_DIM, dtype=F32, requires_grad=weight.requires_grad), weight.device.index
        )
    return weight


UPCAST_REASONS = {  # where the upcast mode's message differs from FLUX.2's for the same case
    "weight dtype": "weight is torch.float16, the upcast rows are torch.float32 (eager would promote)",
    "float32 weight outside the upcast mode": None,  # accepted: the upcast mode's weight is float32
}

UPCAST_CASES: dict[str, tuple[tuple[Any, ...], str]] = {
    "bf16 weight": (
        _args(weight=as_cuda(torch.zeros(HEAD_DIM, dtype=BF16))),
        "weight is torch.bfloat16, the upcast rows are torch.float32 (eager would promote)",
    ),
    "fp16 rows, fp16 weight": (
        _args(x=_x(dtype=torch.float16), weight=as_cuda(torch.zeros(HEAD_DIM, dtype=torch.float16))),
        "weight is torch.float16, the upcast rows are torch.float32 (eager would promote)",
    ),
    "weight 4 bytes off": (
        _args(weight=as_cuda(misaligned(HEAD_DIM, dtype=F32))),
        "weight data pointer is not 16-byte aligned",
    ),
    "weight 8 bytes off": (
        _args(weight=as_cuda(torch.zeros(HEAD_DIM + 2, dtype=F32)[2:])),
        "weight data pointer is not 16-byte aligned",
    ),
    "float32 rows": (
        _args(x=_x(dtype=F32), weight=as_cuda(torch.zeros(HEAD_DIM, dtype=F32))),
        "dtype torch.float32 is not supported (bfloat16, float16)",
    ),
}


def _expect_decline(args: tuple[Any, ...], expected: str, upcast: bool) -> None:
    """The reason, the guard, the entry point and the validated op, in this mode."""
    reason = segment_decline_reason(*args, upcast=upcast)
    assert reason == expected
    assert guards.segment_guard(upcast)(*args) is False
    rows = [Segment(args[0], args[1])]
    assert decline_reason(rows, rows, *args[2:], upcast=upcast) == expected
    assert qk_norm_rope.fused(rows, rows, *args[2:], 1e-6, upcast=upcast) is None
    error = TypeError if isinstance(reason, TypeReason) else ValueError
    with pytest.raises(error, match=f"^{re.escape('flux2-fused: ' + expected)}$"):
        qk_norm_rope.qk_norm_rope(rows, rows, *args[2:], upcast=upcast)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.usefixtures("accept_runtime")
def test_upcast_declines_what_flux2s_mode_declines(name: str) -> None:
    """Every FLUX.2 case with the upcast mode's float32 weight: the same reason, except the weight's dtype."""
    args, expected = CASES[name]
    args = (args[0], _upcast_weight(args[1]), *args[2:])
    expected = UPCAST_REASONS.get(name, expected)
    if expected is None:
        assert segment_decline_reason(*args, upcast=True) is None and guards.upcast_segment(*args)
        return
    _expect_decline(args, expected, upcast=True)


@pytest.mark.parametrize("name", UPCAST_CASES)
@pytest.mark.usefixtures("accept_runtime")
def test_upcast_decline_reason(name: str) -> None:
    args, expected = UPCAST_CASES[name]
    _expect_decline(args, expected, upcast=True)


@pytest.mark.usefixtures("accept_runtime")
def test_upcast_accepts_flux3_layouts() -> None:
    """A float32 weight: one segment of dense rows (separate projections), chunks of a fused qkv
    projection, and the two-segment layout with v; FLUX.2's mode declines the same weight."""
    weight, cos, sin = as_cuda(torch.zeros(HEAD_DIM, dtype=F32)), _table(), _table()
    dense = _x()
    qkv = as_cuda(_x(width=3 * H * HEAD_DIM, cuda=False)[:, :, H : 2 * H])
    for x in (dense, qkv, _x(dtype=torch.float16)):
        assert segment_decline_reason(x, weight, cos, sin, upcast=True) is None
        assert guards.upcast_segment(x, weight, cos, sin)
        assert segment_decline_reason(x, weight, cos, sin) is not None and not guards.segment(
            x, weight, cos, sin
        )
    rows = [Segment(_x(2), weight), Segment(dense, weight)]
    joint = (_table(S + 2), _table(S + 2))
    assert decline_reason(rows, rows, *joint, [_x(2), _x()], upcast=True) is None
    assert decline_reason([Segment(dense, weight)], [Segment(qkv, weight)], cos, sin, upcast=True) is None
    assert value_decline_reason(dense, upcast=True) is None and guards.upcast_value(dense)


@pytest.mark.parametrize("name", V_CASES)
@pytest.mark.usefixtures("accept_runtime")
def test_upcast_value_decline_reason(name: str) -> None:
    v, expected = V_CASES[name]
    assert value_decline_reason(v, upcast=True) == expected
    assert guards.upcast_value(v) is False


def test_each_mode_asks_its_own_self_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLUX.2's guards, the upcast mode's and ComfyUI's rotations' ask for different verdicts (one
    self-check each): a verdict for one never vouches for another."""
    monkeypatch.setattr(runtime, "_records", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(
        runtime,
        "_check",
        lambda op, device, config: runtime.CheckRecord(config.rotation == "kitchen", str(config), 0),
    )
    assert guards.segment_guard(False, "kitchen").runtime(_x()) is None
    assert guards.value_guard(False, "kitchen").runtime(_x()) is None
    assert guards.segment.runtime(_x()) == "self-check failed: head_dim=128 bfloat16"
    assert (
        guards.segment_guard(False, "addcmul").runtime(_x())
        == "self-check failed: head_dim=128 bfloat16 addcmul"
    )
    assert guards.upcast_value.runtime(_x()) == "self-check failed: head_dim=128 bfloat16 upcast"
    assert (
        guards.segment_guard(False, "complex", "mean").runtime(_x())
        == "self-check failed: head_dim=128 bfloat16 complex mean norm"
    )
    assert sorted(str(key[2]) for key in runtime._records) == [
        "head_dim=128 bfloat16",
        "head_dim=128 bfloat16 addcmul",
        "head_dim=128 bfloat16 complex mean norm",
        "head_dim=128 bfloat16 kitchen",
        "head_dim=128 bfloat16 upcast",
    ]


def test_verify_covers_every_mode() -> None:
    """`flux2-fused verify` checks FLUX.2's mode, FLUX.3's, ComfyUI's two rotations and Qwen-Image's
    (diffusers' RMSNorm with the complex rotation), in bf16 and fp16."""
    assert set(OP.verify_configs) == {
        Config(dtype, *mode) for dtype in (torch.bfloat16, torch.float16) for mode in guards.MODES
    }
    assert len(guards.MODES) == 5
    assert str(Config(torch.float16, upcast=True)) == "head_dim=128 float16 upcast"
    assert str(Config(torch.float16, rotation="kitchen")) == "head_dim=128 float16 kitchen"
    assert (
        str(Config(torch.float16, rotation="complex", norm="mean"))
        == "head_dim=128 float16 complex mean norm"
    )


@pytest.mark.parametrize("two", [False, True])
def test_upcast_apply_on_the_cpu_is_the_eager_chain(two: bool) -> None:
    """bf16 rows with float32 norms (FLUX.3): the entry point runs the upcast reference on the CPU,
    with the switch on or off."""
    norms = [torch.nn.RMSNorm(HEAD_DIM, eps=1e-6) for _ in range(2)]
    for norm in norms:
        torch.nn.init.normal_(norm.weight)
    x = torch.randn(B, S, H, HEAD_DIM).to(BF16)
    cos, sin = torch.rand((2 if two else 1) * S, HEAD_DIM), torch.rand((2 if two else 1) * S, HEAD_DIM)
    q = [Segment(x, norms[0].weight)] + ([Segment(x.flip(1), norms[1].weight)] if two else [])
    k = [Segment(x * 2, norms[1].weight)] + ([Segment(x.flip(2), norms[0].weight)] if two else [])
    assert qk_norm_rope.fused(q, k, cos, sin, 1e-6, upcast=True) is None
    with torch.no_grad():
        expected = qk_norm_rope.reference.prologue(q, k, cos, sin, 1e-6, upcast=True)
        for enabled in (True, False):
            got = qk_norm_rope.apply(q, k, cos, sin, 1e-6, upcast=True, enabled=enabled)
            assert got[2] is None and all(
                torch.equal(a, b) for a, b in zip(got[:2], expected[:2], strict=True)
            )
            assert got[0].dtype == BF16
        if not two:  # the one segment of FLUX.3's blocks: norm(x.float()), fp32 RoPE, one cast
            chain = qk_norm_rope.reference.rope(norms[0](x.float()), cos, sin).to(BF16)
            assert torch.equal(expected[0], chain)


@pytest.mark.usefixtures("accept_runtime")
@pytest.mark.parametrize("rotation", ["addcmul", "kitchen"])
def test_accepts_comfyui_tables(rotation: str) -> None:
    """ComfyUI's rotations take its tables one a batch row ([B, S, 128], or [1, S, 128]) as well as
    [S, 128]; the checks are FLUX.2's."""
    weight = _args()[1]
    rows = [Segment(_x(2), weight), Segment(_x(), weight)]
    for tables in (
        _table(S + 2),
        as_cuda(torch.zeros(B, S + 2, HEAD_DIM)),
        as_cuda(torch.zeros(1, S + 2, HEAD_DIM)),
    ):
        assert decline_reason(rows, rows, tables, tables, [_x(2), _x()], rotation=rotation) is None
        assert guards.segment_guard(False, rotation)(rows[1].x, weight, tables, tables)
    assert segment_decline_reason(*_args(weight=as_cuda(torch.zeros(HEAD_DIM))), rotation=rotation) == (
        "weight is torch.float32, x is torch.bfloat16 (eager would promote)"
    )


@pytest.mark.usefixtures("accept_runtime")
def test_accepts_qwen_and_z_image_layouts() -> None:
    """diffusers' RMSNorm with the complex rotation takes Qwen-Image's double block (text and image
    segments with v, one [S, 128] table) and Z-Image's single stream (one segment, a table a batch
    row); its weight has x's dtype, as FLUX.2's does."""
    mode = {"rotation": "complex", "norm": "mean"}
    weight = _args()[1]
    rows = [Segment(_x(3), weight), Segment(_x(), weight)]  # 2 x 3 x 3 and 2 x 5 x 3 head rows
    table = _table(S + 3)
    assert decline_reason(rows, rows, table, table, [_x(3), _x()], **mode) is None
    batched = as_cuda(torch.zeros(B, S, HEAD_DIM))
    assert decline_reason(rows[1:], rows[1:], batched, batched, **mode) is None
    assert segment_decline_reason(*_args(weight=as_cuda(torch.zeros(HEAD_DIM))), **mode) == (
        "weight is torch.float32, x is torch.bfloat16 (eager would promote)"
    )


FEW_ROWS = "6 head rows in the segment: aten's mean sums a row in one warp from 16 rows"


@pytest.mark.usefixtures("accept_runtime")
def test_the_mean_norm_declines_a_segment_of_few_head_rows() -> None:
    """diffusers' RMSNorm on fewer than 16 head rows (one token of three heads, batch 2): aten's mean
    then spreads a row over more threads; the fused norm (aten's own kernel) is not affected."""
    weight = _args()[1]
    one = as_cuda(torch.zeros(B, 1, H, HEAD_DIM, dtype=BF16))
    table = _table(1)
    assert segment_decline_reason(one, weight, table, table, rotation="complex", norm="mean") == FEW_ROWS
    assert segment_decline_reason(one, weight, table, table) is None


MODE_CASES = {
    "unknown rotation": (
        (False, "rope", "fused"),
        "rotation 'rope' is not one of ('aten', 'addcmul', 'kitchen', 'complex')",
    ),
    "unknown norm": ((False, "aten", "layer"), "norm 'layer' is not one of ('fused', 'mean')"),
    "upcast with ComfyUI's rotation": (
        (True, "kitchen", "fused"),
        "the upcast mode rotates and normalizes as FLUX.3 does (rotation 'aten', norm 'fused')",
    ),
    "upcast with diffusers' RMSNorm": (
        (True, "complex", "mean"),
        "the upcast mode rotates and normalizes as FLUX.3 does (rotation 'aten', norm 'fused')",
    ),
    "diffusers' RMSNorm with FLUX's rotation": (
        (False, "aten", "mean"),
        "diffusers' RMSNorm ('mean') is fused with the complex rotation only, and it with that norm",
    ),
    "the complex rotation with aten's RMSNorm": (
        (False, "complex", "fused"),
        "diffusers' RMSNorm ('mean') is fused with the complex rotation only, and it with that norm",
    ),
}


@pytest.mark.parametrize("name", MODE_CASES)
@pytest.mark.usefixtures("accept_runtime")
def test_declines_modes_the_kernel_has_not(name: str) -> None:
    (upcast, rotation, norm), expected = MODE_CASES[name]
    mode = {"upcast": upcast, "rotation": rotation, "norm": norm}
    weight = as_cuda(torch.zeros(HEAD_DIM, dtype=F32 if upcast else BF16))
    rows, cos, sin = [Segment(_x(), weight)], _table(), _table()
    assert decline_reason(rows, rows, cos, sin, **mode) == expected
    assert segment_decline_reason(rows[0].x, weight, cos, sin, **mode) == expected
    assert qk_norm_rope.fused(rows, rows, cos, sin, 1e-6, **mode) is None
    with pytest.raises(ValueError, match=f"^{re.escape('flux2-fused: ' + expected)}$"):
        qk_norm_rope.qk_norm_rope(rows, rows, cos, sin, **mode)
    for guard in (guards.segment_guard, guards.value_guard):
        with pytest.raises(ValueError, match=f"^{re.escape('flux2-fused: ' + expected)}$"):
            guard(upcast, rotation, norm)
