"""CPU tests of the kernel benchmark's shapes: each op's layouts (FLUX.3's per-token, two-term, twin
and upcast sites among them) parse after a colon and no other op's do, the default run times every
layout, and a case asked for a layout its op lacks says so before it touches a GPU."""

from __future__ import annotations

import re

import pytest
import torch

from flux2_fused.bench import kernel
from flux2_fused.errors import BadValue


@pytest.mark.parametrize(
    ("op", "item", "parsed"),
    [
        ("gated_resnorm", "3072x4096", (3072, 4096, "")),
        ("gated_resnorm", "3072x4096:token", (3072, 4096, "token")),
        ("gated_resnorm", "3072x512:UPDATE2", (3072, 512, "update2")),
        ("gated_resnorm", "3072x4608:twin", (3072, 4608, "twin")),
        ("qk_norm_rope", "24x4608:single", (24, 4608, "single")),
        ("qk_norm_rope", "24x4096:upcast", (24, 4096, "upcast")),
        ("qk_norm_rope", "24x4608:qwen", (24, 4608, "qwen")),
        ("sandwich_norm", "3840x4608", (3840, 4608, "")),
        ("sandwich_norm", "3840x4608:last", (3840, 4608, "last")),
        ("swiglu", "10240x4608:pair", (10240, 4608, "pair")),
        ("swiglu", "9216x4608:single", (9216, 4608, "single")),
        ("swiglu", "9216x4096:quant-tensor", (9216, 4096, "quant-tensor")),
        ("swiglu", "9216x4608:single-tensor", (9216, 4608, "single-tensor")),
        ("gelu_tanh", "12288x4096:quant", (12288, 4096, "quant")),
        ("gelu_tanh", "12288x4608:single-tensor", (12288, 4608, "single-tensor")),
        ("float8_quant", "3072x4608:tensor", (3072, 4608, "tensor")),
        ("uniform_rows", "9216x4096", (9216, 4096, "")),
    ],
)
def test_each_ops_layouts_parse(op: str, item: str, parsed: tuple[int, int, str]) -> None:
    assert kernel.parse_shape(op, item) == parsed


@pytest.mark.parametrize(
    ("op", "item"),
    [
        ("gated_resnorm", "3072x4096:upcast"),
        ("gated_resnorm", "3072x4096:single"),
        ("qk_norm_rope", "24x4608:twin"),
        ("qk_norm_rope", "24x4608:token"),
        ("swiglu", "9216x4608:update2"),
        ("swiglu", "9216x4608:tensor"),
        ("gelu_tanh", "12288x4608:upcast"),
        ("gelu_tanh", "12288x4608:pair"),
        ("sandwich_norm", "3840x4608:twin"),
        ("uniform_rows", "9216x4096:token"),
    ],
)
def test_another_ops_layout_is_refused_naming_the_forms(op: str, item: str) -> None:
    with pytest.raises(BadValue, match=re.escape(f"--op {op} takes {kernel.SHAPE_FORMS[op]}")):
        kernel.parse_shape(op, item)


@pytest.mark.parametrize("op", kernel.CASES)
def test_the_default_run_times_every_layout(op: str) -> None:
    assert {kernel.parse_shape(op, item)[2] for item in kernel.DEFAULT_SHAPES[op]} == set(kernel.LAYOUTS[op])
    assert all(f":{layout}" in kernel.SHAPE_FORMS[op] for layout in kernel.LAYOUTS[op] if layout)


@pytest.mark.parametrize("op", ["gated_resnorm", "qk_norm_rope", "gelu_tanh"])
def test_a_case_refuses_a_layout_before_it_touches_a_gpu(op: str) -> None:
    with pytest.raises(ValueError, match=f"unknown {op} layout 'double'"):
        kernel.CASES[op](24, 64, 1, torch.bfloat16, "double")


def test_an_output_a_site_does_not_produce_compares_as_none() -> None:
    """sandwich_norm's last site returns no next norm (None) from both the fused op and the eager
    chain: equal; None beside a tensor is not."""
    t = torch.ones(2, 3)
    assert kernel._same(None, None) and kernel._same(t, t.clone())
    assert not kernel._same(None, t) and not kernel._same(t, None)
    q = torch.tensor([0.5, float("nan")]).to(torch.float8_e4m3fn)
    assert kernel._same(q, q.clone()) and not kernel._same(q, torch.zeros_like(q))
