"""CPU tests of the clock sampler's reading and summary of nvidia-smi's output; the sampling itself
(nvidia-smi during real steps) on a GPU."""

from __future__ import annotations

import dataclasses
import datetime
import math
import re

import pytest

from flux2_fused.bench.clocks import (
    Block,
    Sample,
    format_blocks,
    main,
    parse_samples,
    reason_names,
    summarize,
)

from . import one_line_error

# nvidia-smi --query-gpu=...,clocks_event_reasons.active --format=csv,noheader,nounits
OUTPUT = """\
2026/12/01 20:55:01.100, 1980, 3201, 612.40, 51, 0x0000000000000000
2026/12/01 20:55:01.120, 1635, 3201, 699.10, 55, 0x0000000000000004
2026/12/01 20:55:01.140, 1395, 3201, [N/A], 56, 0x0000000000000004
2026/12/01 20:55:01.160, 1410, 3201, 701.00, 58, 0x0000000000000024
2026/12/01 20:55:01.1"""


def test_readings_are_parsed_and_unreadable_lines_skipped() -> None:
    samples = parse_samples(OUTPUT)
    assert [s.sm_mhz for s in samples] == [1980, 1635, 1410]  # "[N/A]" and the partial line skipped
    assert samples[1] == Sample(
        datetime.datetime(2026, 12, 1, 20, 55, 1, 120000).timestamp(), 1635, 3201, 699.1, 55, 0x4
    )


def test_reason_bits_are_named() -> None:
    assert reason_names(0) == []
    assert reason_names(0x24) == ["software power cap", "software thermal slowdown"]
    assert reason_names(0x1000 | 0x8) == ["hardware slowdown", "0x1000"]


def test_a_block_summarizes_its_readings() -> None:
    block = summarize("fused", 30, 55.5, parse_samples(OUTPUT))
    assert (block.sm_mhz_median, block.sm_mhz_min, block.sm_mhz_max) == (1635, 1410, 1980)
    assert block.power_w_median == 699.1 and block.temperature_c_last == 58 and block.samples == 3
    assert block.reasons == pytest.approx({"software power cap": 2 / 3, "software thermal slowdown": 1 / 3})
    empty = summarize("eager", 30, 50.0, [])
    assert math.isnan(empty.sm_mhz_median) and empty.reasons == {}
    documented = set(re.findall(r"^\s*- (\w+):", Block.__doc__ or "", re.MULTILINE))
    assert documented == {f.name for f in dataclasses.fields(Block)}


def test_the_table_has_a_row_a_block() -> None:
    blocks = [summarize(m, 30, ms, parse_samples(OUTPUT)) for m, ms in (("eager", 60.0), ("fused", 55.5))]
    table = format_blocks("klein-4b", blocks)
    assert "| klein-4b | 1 | fused | 55.50 | 1635 (1410-1980) | 3201 | 699 | 58 |" in table
    assert "software power cap 67%, software thermal slowdown 33%" in table


@pytest.mark.gpu
def test_blocks_on_the_gpu() -> None:
    """Four short blocks of klein-4B, the three modes taking turns: each has readings, a clock and a
    step time, the GEMMs and attention alone the shortest."""
    from flux2_fused.bench.clocks import run_blocks

    blocks = run_blocks(
        "klein-4b", "package", blocks=4, steps=5, interval_ms=20, modes=("eager", "fused", "floor")
    )
    assert [b.mode for b in blocks] == ["eager", "fused", "floor", "eager"]
    assert blocks[2].step_ms < blocks[1].step_ms < blocks[0].step_ms
    assert all(b.samples > 0 and b.sm_mhz_median > 0 and b.step_ms > 0 for b in blocks)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--blocks", "0"], "--blocks, --steps and --interval-ms must be at least 1"),
        (["--configs", "flux1-dev"], "flux1-dev: FLUX.1 has no model of the package's own; run it with"),
        (["--modes", "eager", "compiled"], "argument --modes: invalid choice: 'compiled'"),
        (["--quantize", "float8-row"], "--quantize needs --host diffusers"),
        (["--host", "diffusers", "--quantize", "fp4"], "argument --quantize: invalid choice: 'fp4'"),
    ],
)
def test_bad_arguments_are_one_line_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = one_line_error(main, argv, capsys)
    assert err.startswith(f"python -m flux2_fused.bench.clocks: error: {message}")
