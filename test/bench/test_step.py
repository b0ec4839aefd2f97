"""CPU tests of the step benchmark's statistics, of the benchmarks' kernel classifier and of the GPU
benchmarks' tables; their CUDA timing and profiling need a GPU."""

from __future__ import annotations

import dataclasses
import math
import re
import time
from pathlib import Path

import pytest

from flux2_fused.bench import plot
from flux2_fused.bench.classify import fused_op, kernel_class
from flux2_fused.bench.results.kernel import KernelReport, KernelRow, format_kernel_table
from flux2_fused.bench.results.pipeline import PipelineResult, format_pipeline_table
from flux2_fused.bench.results.step import OpTraffic, StepResult, format_step_table
from flux2_fused.bench.results.tables import KERNEL_CLASSES, SITES, Breakdown, Paired, Timing
from flux2_fused.bench.results.verify import VerifyRow, format_verify
from flux2_fused.bench.step import _pair_order, breakdown_of, busy_pct, host_ms, op_traffic, shapes
from flux2_fused.cli import build_parser
from flux2_fused.ops import FUSED_KERNELS, KERNEL_OPS

# Kernel names in the form torch.profiler reports them on Hopper (cuBLAS, cuBLASLt, cuDNN, flash,
# memory-efficient attention, aten, Inductor and this package's kernels), with the class of each.
KERNEL_NAMES = [
    (
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>"
        "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8::Params)",
        "gemm",
    ),
    (
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"
        "_kernel__5x_cublas",
        "gemm",
    ),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT", "gemm"),
    (
        "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false>(...)",
        "gemm",
    ),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>(...)", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
    (
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false>, true>(...)",
        "attention",
    ),
    (
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)",
        "attention",
    ),
    (
        "void flux2_fused::gated_resnorm_kernel<__nv_bfloat16, 12, true, true>(__nv_bfloat16 const*, ...)",
        "fused",
    ),
    (
        "void flux2_fused::qk_norm_rope::qk_norm_rope_kernel<__nv_bfloat16>(__nv_bfloat16 const*, ...)",
        "fused",
    ),
    (
        "void flux2_fused::swiglu_kernel<__nv_bfloat16, 8>(__nv_bfloat16 const*, __nv_bfloat16*, long)",
        "fused",
    ),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl<...> >(int, ...)", "other"),
    (
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, true>"
        "(int, float, c10::BFloat16 const*, ...)",
        "other",
    ),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(...)>(...)", "other"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>(...)", "other"),
    ("Memcpy DtoD (Device -> Device)", "other"),
    ("triton_poi_fused_add_mul_0", "other"),  # Inductor's fusions are not ours
]


def test_pairs_alternate_which_mode_runs_first() -> None:
    assert _pair_order(3) == [False, True, True, False, False, True]


def test_timing_pairs_steps_by_position() -> None:
    eager, fused = [10.0, 12.0, 11.0, 30.0], [9.0, 12.5, 10.0, 29.0]
    t = Timing.of({False: eager, True: fused})
    assert (t.eager_ms, t.fused_ms) == (11.5, 11.25)
    assert t.speedup_pct == pytest.approx(100 * (11.5 / 11.25 - 1))
    assert t.paired_diff_ms == pytest.approx(0.625)  # mean of 1, -0.5, 1, 1
    assert t.paired_ci95_ms == pytest.approx(1.96 * 0.75 / 2)  # sample sd of the differences is 0.75
    assert t.fused_won == 3


def test_paired_is_the_mean_difference_with_its_interval() -> None:
    """The compiled step against the fused one: the same statistics as eager's, other minus fused."""
    p = Paired.of([11.0, 12.0, 10.5, 31.0], [10.0, 12.5, 9.5, 30.0])
    assert p.diff_ms == pytest.approx(0.625) and p.fused_won == 3
    assert p.ci95_ms == pytest.approx(1.96 * 0.75 / 2)
    t = Timing.of({False: [11.0, 12.0, 10.5, 31.0], True: [10.0, 12.5, 9.5, 30.0]})
    assert (t.paired_diff_ms, t.paired_ci95_ms, t.fused_won) == (p.diff_ms, p.ci95_ms, p.fused_won)
    assert Paired.of([9.0], [10.0]).fused_won == 0 and math.isnan(Paired.of([9.0], [10.0]).ci95_ms)
    with pytest.raises(ValueError):
        Paired.of([1.0, 2.0], [1.0])  # pairs, or nothing


@pytest.mark.parametrize(
    ("name", "expected"), KERNEL_NAMES, ids=[c + str(i) for i, (_, c) in enumerate(KERNEL_NAMES)]
)
def test_kernel_class_sorts_real_kernel_names(name: str, expected: str) -> None:
    assert kernel_class(name, KERNEL_CLASSES) == expected


def test_every_fused_kernel_is_fused_in_both_benchmarks() -> None:
    """The step benchmark's classes and `flux2-fused bench`'s sites read one table of every op's kernel."""
    assert len(FUSED_KERNELS) == 7
    for kernel in FUSED_KERNELS:
        name = f"void flux2_fused::{kernel}<__nv_bfloat16>(...)"
        assert kernel_class(name, KERNEL_CLASSES) == "fused" and kernel_class(name, SITES) == "fused"


@pytest.mark.parametrize(
    ("name", "step_class", "site"),
    [
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT", "gemm", "other"),
        ("void pytorch_flash::flash_fwd_kernel<...>(...)", "attention", "other"),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collective", "other"),
        ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<...>(...)", "other", "norm"),
        ("void at::native::vectorized_elementwise_kernel<4, ...>(int, ...)", "other", "elementwise"),
        ("Memcpy DtoD (Device -> Device)", "other", "other"),
    ],
)
def test_a_class_a_benchmark_does_not_report_is_other(name: str, step_class: str, site: str) -> None:
    """One table, each benchmark its own classes: what the other one splits out is its other."""
    assert kernel_class(name, KERNEL_CLASSES) == step_class
    assert kernel_class(name, SITES) == site


def test_breakdown_sums_time_and_launches_by_class() -> None:
    b = breakdown_of([(name, 1000.0 * (i + 1)) for i, (name, _) in enumerate(KERNEL_NAMES)])
    assert list(b.kernel_ms) == list(b.launches) == list(KERNEL_CLASSES)
    for cls in KERNEL_CLASSES:
        indices = [i for i, (_, c) in enumerate(KERNEL_NAMES) if c == cls]
        assert b.launches[cls] == len(indices)
        assert b.kernel_ms[cls] == pytest.approx(sum(i + 1 for i in indices))  # 1000 us = 1 ms
    assert b.total_launches == len(KERNEL_NAMES)
    assert b.total_ms == pytest.approx(sum(range(1, len(KERNEL_NAMES) + 1)))
    empty = breakdown_of([])
    assert empty.total_launches == 0 and empty.kernel_ms == dict.fromkeys(KERNEL_CLASSES, 0.0)


def test_a_fused_kernel_is_its_ops_and_the_steps_kernels_split_by_op() -> None:
    """Every op's kernel names it, whatever the instantiation (float8_quant's two per-tensor kernels
    included); other kernels name none. The fused step's kernels add up by op, each op beside the
    bytes its launches moved, in their order; an op counted but not profiled has no time."""
    ops = {"gated_resnorm", "qk_norm_rope", "swiglu", "gelu_tanh", "sandwich_norm", "float8_quant"}
    assert set(KERNEL_OPS.values()) == {*ops, "uniform_rows"}
    for kernel, op in KERNEL_OPS.items():
        assert fused_op(f"void flux2_fused::{op}::{kernel}<__nv_bfloat16, true>(...)") == op
    assert fused_op("void flux2_fused::float8_quant::float8_quant_kernel_amax<__half>(...)") == "float8_quant"
    assert all(fused_op(name) is None for name, cls in KERNEL_NAMES if cls != "fused")
    kernels = [
        ("void flux2_fused::qk_norm_rope_kernel<__nv_bfloat16, true, 0, 0>(...)", 30.0),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT", 500.0),
        ("void flux2_fused::swiglu_kernel<__nv_bfloat16, 8>(...)", 60.0),
        ("void flux2_fused::qk_norm_rope_kernel<__nv_bfloat16, true, 0, 0>(...)", 10.0),
    ]
    moved = {"swiglu": 2_000_000, "qk_norm_rope": 1_000_000, "uniform_rows": 5}
    assert op_traffic(kernels, moved) == [
        OpTraffic("swiglu", 1, 0.002, pytest.approx(0.06)),
        OpTraffic("qk_norm_rope", 2, 0.001, pytest.approx(0.04)),
        OpTraffic("uniform_rows", 0, 5e-9, 0.0),
    ]


def test_breakdown_fields_are_documented() -> None:
    """Breakdown is nested in StepResult's JSON, so its fields are documented like the report classes'."""
    documented = set(re.findall(r"^\s*- (\w+):", Breakdown.__doc__ or "", re.MULTILINE))
    assert documented == {field.name for field in dataclasses.fields(Breakdown)}


def _table_widths(text: str) -> set[int]:
    """Cell counts of the markdown rows of `text` (one value when every row matches the header)."""
    return {line.count("|") for line in text.splitlines() if line.startswith("|")}


def test_the_gpu_benchmarks_tables_render_on_the_cpu() -> None:
    """The step, kernel and verify tables are printed only on a GPU: check them with made-up figures."""
    timing = Timing.of({False: [10.0, 12.0], True: [9.0, 11.0]})
    eager = Breakdown(
        {"gemm": 6.5, "attention": 2.25, "fused": 0.0, "collective": 0.0, "other": 1.75},
        {"gemm": 500, "attention": 50, "fused": 0, "collective": 0, "other": 706},
    )
    fused = Breakdown(
        {"gemm": 6.5, "attention": 2.25, "fused": 0.5, "collective": 0.0, "other": 0.75},
        {"gemm": 500, "attention": 50, "fused": 41, "collective": 0, "other": 461},
    )
    step = StepResult(
        "klein-4b", 1, 2, 4096, 512, timing, timing, 1256, 1052, 41, eager, fused, "a" * 64, "a" * 64, True
    )
    on_diffusers = dataclasses.replace(step, host="diffusers", lora_rank=16, offload="model", fused_gb=1.704)
    scanned = dataclasses.replace(
        step,
        batch=4,
        img_tokens=4080,
        width=1360,
        height=768,
        busy_pct={"eager": 96.84, "fused": 99.12, "compiled": 98.5},
        host_ms={"eager": 80.123, "fused": 46.0, "compiled": 1.5},
        compiled_ms=11.0,
        compiled_vs_fused=Paired.of([11.5, 10.5], [10.0, 10.0]),  # +1.0, sd 0.71 over 2 pairs
        compiled_sha256="d" * 64,
        compiled_fused_ms=10.5,
        compiled_fused_sha256="e" * 64,
        graph_ms=8.0,
        graph_bit_exact=True,
        floor_ms=8.0,
        fused_gb=1.704,  # in the fused kernels' 0.50 ms: 3408 GB/s, 80% of 4260
        copy_gbs=4260.0,
        floor_profile=Breakdown(
            {"gemm": 6.25, "attention": 2.0, "fused": 0.0, "collective": 0.0, "other": 0.0},
            {"gemm": 500, "attention": 50, "fused": 0, "collective": 0, "other": 0},
        ),
        fused_ops=[OpTraffic("gated_resnorm", 41, 1.704, 0.5), OpTraffic("uniform_rows", 0, 0.001, 0.0)],
        copied_ms=9.0,
        copied_profile=Breakdown(
            {"gemm": 6.5, "attention": 2.0, "fused": 0.0, "collective": 0.0, "other": 0.4},
            {"gemm": 500, "attention": 50, "fused": 0, "collective": 0, "other": 41},
        ),
    )
    table = format_step_table([step, on_diffusers, scanned], "NVIDIA H200", "2.11.0")
    timings, breakdown, traffic = table.split("\n\n")
    assert "eager = diffusers' own forward, fused = enable(model)" in timings
    assert _table_widths(timings) == {23}
    assert "| fused vs compiled: paired gain ms (95% CI), fused won |" in timings
    assert (
        "| klein-4b | package | 1 | 4096+512 | pipelined | 11.00 | 10.00 | +10.0% "
        "| - | - | - | - | - | - | - | - |" in timings
    )
    assert "| klein-4b | diffusers (LoRA r16, model offload) | 1 | 4096+512 | synchronized |" in timings
    # The compile column's paired gain: mean 1.00 ms, 95% CI 1.96 * 0.71 / sqrt(2), both pairs won.
    assert (
        "| klein-4b | package | 4 | 1360x768 (4080+512) | pipelined | 11.00 | 10.00 | +10.0% "
        "| 11.00 (+10.0%) | +1.00 +- 0.98, 2/2 | 10.50 (+4.8%) | 8.00 (+25.0%), bit-exact | 8.00 (+25.0%) "
        "| 9.00 (+11.1%) | eager 96.8 / fused 99.1 / compiled 98.5 "
        "| eager 80.12 / fused 46.00 / compiled 1.50 | +1.00 +- 0.00 | 2/2 |" in timings
    )
    assert (
        "| 1360x768 (4080+512) | synchronized | 11.00 | 10.00 | +10.0% | - | - | - | - | - | - | - | - |"
        in timings
    )
    assert _table_widths(breakdown) == {14}
    assert (
        "| klein-4b | package | 1 | 4096+512 | eager | 1256 | 6.50 (500) | 2.25 (50) | 0.00 (0) | 0.00 (0) "
        "| 1.75 (706) | 10.50 | - |" in breakdown
    )
    assert (
        "| klein-4b | package | 1 | 4096+512 | fused | 1052 | 6.50 (500) | 2.25 (50) | 0.50 (41) | 0.00 (0) "
        "| 0.75 (461) | 10.00 | - |" in breakdown
    )
    # The fused kernels' bytes alone where the copy bandwidth was not measured; with it, their share.
    assert "| klein-4b | diffusers (LoRA r16, model offload) | 1 | 4096+512 | fused | 1052 |" in breakdown
    assert "| 0.75 (461) | 10.00 | 1.70 |" in breakdown
    assert "| klein-4b | package | 4 | 1360x768 (4080+512) | fused | 1052 |" in breakdown
    assert "| 0.75 (461) | 10.00 | 1.70 (3.41 of 4.26 TB/s, 80%) |" in breakdown
    assert (
        "| klein-4b | package | 4 | 1360x768 (4080+512) | GEMM + attention alone | 550 | 6.25 (500) "
        "| 2.00 (50) | 0.00 (0) | 0.00 (0) | 0.00 (0) | 8.25 | - |" in breakdown
    )
    assert breakdown.count("GEMM + attention alone") == 1
    assert (
        "| klein-4b | package | 4 | 1360x768 (4080+512) | with the fused bytes copied (as other) | 591 "
        "| 6.50 (500) | 2.00 (50) | 0.00 (0) | 0.00 (0) | 0.40 (41) | 8.90 | - |" in breakdown
    )
    # The op table: each op's bandwidth in the step against the copy's (1.704 GB in 0.5 ms: 80%).
    assert _table_widths(traffic) == {11}
    assert (
        "| klein-4b | package | 4 | 1360x768 (4080+512) | gated_resnorm | 41 | 1.70 | 0.50 | 3.41 | 80% |"
        in traffic
    )
    assert "| uniform_rows | 0 | 0.00 | 0.00 | - | - |" in traffic
    assert format_step_table([step], "NVIDIA H200", "2.11.0").count("\n\n") == 1  # no op counted: no table
    # Blocks: the pipelined row says so and counts steps * block pairs.
    blocked = format_step_table([dataclasses.replace(step, block=3, lead_in=5)], "NVIDIA H200", "2.11.0")
    assert "| 4096+512 | pipelined, blocks of 3 after 5 | 11.00 | 10.00 |" in blocked
    assert "| +1.00 +- 0.00 | 2/6 |" in blocked and "| +1.00 +- 0.00 | 2/2 |" in blocked
    assert "diffusers' own forward" not in format_step_table([step], "NVIDIA H200", "2.11.0")
    calls = PipelineResult(
        "klein-4b", 1024, 1024, 8, 4.0, 512, 2, "magcache", 500, "0.42.1", timing, "b" * 64, "c" * 64, False
    )
    table = format_pipeline_table([calls], "NVIDIA H200", "2.11.0")
    assert "diffusers 0.42.1" in table and _table_widths(table) == {15}
    assert (
        "| klein-4b | 1024x1024 | 8 | 4.0 | magcache | 11.0 | 10.0 | +10.0% | +1.0 +- 0.0 | 2/2 | 500 | 2.0 "
        "| NO |" in table
    )
    assert "| bbbbbbbbbbbb / cccccccccccc |" in table
    row = KernelRow(
        "gated_resnorm",
        3072,
        4096,
        1,
        184.0,
        135.1,
        None,
        80.0,
        28.3,
        23.8,
        84.1,
        25.5,
        90.1,
        2.3,
        4.77,
        True,
    )
    table = format_kernel_table(KernelReport("NVIDIA H200", "2.11.0", 4230.0, [row]))
    assert _table_widths(table) == {17} and "| gated_resnorm | 3072 | 4096 | 1 | 184.0 | 135.1 | - |" in table
    table = format_verify(
        [VerifyRow("gated_resnorm", "D=3072 bf16", False, "bit 3 differs", 0.1, "cache, sm 9.0")],
        "H200",
        "2.11",
    )
    assert _table_widths(table) == {7} and table.endswith("1 of 1 FAILED") and "| cache, sm 9.0 |" in table


def test_host_ms_times_the_issue_of_each_step_after_a_sync_and_takes_the_median() -> None:
    """Each step is timed from a synchronize to its return, the GPU never waited for inside the
    timing: a step's own sleep counts, the syncs do not."""
    events: list[str] = []
    issue_ms = iter([1.0, 30.0, 2.0, 3.0, 2.5])

    def step() -> None:
        events.append("step")
        time.sleep(next(issue_ms) / 1e3)

    def sync() -> None:
        events.append("sync")
        time.sleep(0.05)  # never inside a timed interval, or every figure would exceed 50 ms

    assert 2.5 <= host_ms(step, steps=5, sync=sync) < 30.0
    assert events == ["sync", "step"] * 5 + ["sync"]


@pytest.mark.parametrize(
    ("intervals", "expected"),
    [
        ([(0.0, 10.0)], 100.0),
        ([(0.0, 4.0), (6.0, 10.0)], 80.0),  # a 2 us gap in 10
        ([(6.0, 10.0), (0.0, 4.0)], 80.0),  # in any order
        ([(0.0, 6.0), (2.0, 4.0), (5.0, 10.0)], 100.0),  # nested and overlapping (two streams)
        ([(0.0, 1.0), (9.0, 10.0), (0.5, 2.0)], 30.0),
        ([(3.0, 3.0)], 100.0),  # one instant: nothing to wait in
        ([], 0.0),
    ],
)
def test_busy_pct_is_the_union_of_intervals_over_their_span(
    intervals: list[tuple[float, float]], expected: float
) -> None:
    assert busy_pct(intervals) == pytest.approx(expected)


def test_the_runs_of_the_size_options() -> None:
    """--sizes lays each size's tokens out as its rows, --img-tokens a square, neither 1024x1024."""
    parser = build_parser()[1]["step"]
    assert shapes(parser.parse_args(["--sizes", "512x512", "1360x768"])) == [
        (1024, (512, 512)),
        (4080, (1360, 768)),
    ]
    assert shapes(parser.parse_args(["--img-tokens", "1000"])) == [(1000, None)]
    assert shapes(parser.parse_args([])) == [(4096, (1024, 1024))]
    assert parser.parse_args(["--batch", "1", "4"]).batch == [1, 4]
    # --vs-compile alone compiles the eager forward; "both" the fused one too.
    assert parser.parse_args([]).vs_compile is None and not parser.parse_args([]).floor
    assert parser.parse_args(["--vs-compile", "--floor"]).vs_compile == "eager"
    assert parser.parse_args(["--vs-compile", "both"]).vs_compile == "both"


def test_the_size_plot_draws_every_config(tmp_path: Path) -> None:
    """`step --plot`: a PNG, a panel a config, drawn from results (made up here; a GPU makes them)."""
    pytest.importorskip("matplotlib")
    timing = Timing.of({False: [10.0, 12.0], True: [9.0, 11.0]})
    empty = Breakdown(dict.fromkeys(KERNEL_CLASSES, 0.0), dict.fromkeys(KERNEL_CLASSES, 0))
    results = [
        StepResult(
            config,
            batch,
            2,
            tokens,
            512,
            timing,
            timing,
            1,
            1,
            0,
            empty,
            empty,
            "a" * 64,
            "a" * 64,
            True,
            width=side,
            height=side,
            compiled_ms=10.5,
            compiled_fused_ms=10.0,
            floor_ms=8.5,
        )
        for config in ("klein-4b", "dev")
        for batch in (1, 4)
        for side, tokens in ((512, 1024), (1024, 4096))
    ]
    path = tmp_path / "scan.png"
    plot.save_step_plot(results, path)
    assert path.read_bytes().startswith(b"\x89PNG")


@pytest.mark.gpu
def test_a_scan_row_on_the_gpu() -> None:
    """Two sizes (one not square) at batch 2 of the package's klein-4B, each one row: bit-exact, the
    size kept, every mode's busy % measured, the compiled eager forward and the fused step's CUDA
    graph (its replay bit-exact) timed beside them."""
    from flux2_fused.bench.step import Subject, bench_size

    subject = Subject("klein-4b", "package", None, "none", "none")
    rows = [
        bench_size(
            subject,
            2,
            2,
            (w // 16) * (h // 16),
            32,
            (w, h),
            vs_compile="both" if extra else None,
            graph=extra,
            floor=extra,
        )
        for (w, h), extra in (((256, 256), False), ((512, 256), True))
    ]
    assert all(r.bit_exact and r.fused_kernel_launches == 96 for r in rows)
    assert [(r.width, r.height, r.img_tokens) for r in rows] == [(256, 256, 256), (512, 256, 512)]
    assert set(rows[0].busy_pct) == {"eager", "fused"} and rows[0].compiled_ms is None
    modes = {"eager", "fused", "compiled", "compiled-fused", "graph", "floor", "copied"}
    assert set(rows[1].busy_pct) == modes and rows[1].compiled_ms > 0 and rows[1].compiled_fused_ms > 0
    assert rows[1].graph_bit_exact and rows[1].graph_ms > 0 and rows[0].graph_ms is None
    assert all(0 < pct <= 100 for r in rows for pct in r.busy_pct.values())
    assert all(set(r.host_ms) == set(r.busy_pct) and all(ms > 0 for ms in r.host_ms.values()) for r in rows)
    assert rows[1].compiled_sha256 is not None and rows[1].compiled_fused_sha256 is not None
    # The floor replays the fused step's GEMMs and attention: the same launches, nothing else.
    floor, fused = rows[1].floor_profile, rows[1].fused_profile
    assert rows[0].floor_ms is None and 0 < rows[1].floor_ms < rows[1].pipelined.fused_ms
    assert floor.launches["gemm"] == fused.launches["gemm"] and floor.launches["fused"] == 0
    assert floor.launches["attention"] == fused.launches["attention"]
    # The copied step: the same GEMMs and attention, and one copy (other) for each fused launch.
    copied = rows[1].copied_profile
    assert rows[0].copied_ms is None and rows[1].floor_ms < rows[1].copied_ms
    assert copied.launches["gemm"] == fused.launches["gemm"] and copied.launches["fused"] == 0
    assert copied.launches["attention"] == fused.launches["attention"]
    assert copied.launches["other"] == floor.launches["other"] + fused.launches["fused"]
    # The fused kernels' bytes were counted (96 launches' arguments) and the copy bandwidth measured;
    # by op, the bytes add up to them and the launches and time to the fused step's profile.
    assert all(r.fused_gb > 0 and r.copy_gbs > 1000 for r in rows)
    for r in rows:
        assert sum(t.gb for t in r.fused_ops) == pytest.approx(r.fused_gb)
        assert sum(t.launches for t in r.fused_ops) == r.fused_profile.launches["fused"]
        assert sum(t.kernel_ms for t in r.fused_ops) == pytest.approx(r.fused_profile.kernel_ms["fused"])
        assert {t.op for t in r.fused_ops} == {"gated_resnorm", "qk_norm_rope", "swiglu"}
    assert rows[1].fused_gb > rows[0].fused_gb  # twice the image tokens


def test_compiled_modes_switch_without_recompiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the diffusers host each compiled mode traces a model of its own (twins holding the same
    weight tensors, one enabled once) that no switch changes, so alternating modes recompiles
    nothing; the twins compute what the model computes in each mode."""
    import functools

    import torch

    from flux2_fused.bench import hosts
    from flux2_fused.bench.step import Subject
    from flux2_fused.models.flux2 import Flux2Config, Flux2Transformer, image_ids, text_ids

    config = Flux2Config.preset("tiny")
    subject = object.__new__(Subject)  # the GPU constructor's fields, on the CPU
    subject.name, subject.diffusers, subject.comfyui, subject._twins = "tiny", True, False, {}
    subject.model = hosts.diffusers_model(Flux2Transformer.random(config, seed=0)).eval()
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(2, 16, config.in_channels, generator=gen),
        "encoder_hidden_states": torch.randn(2, 8, config.joint_attention_dim, generator=gen),
        "timestep": torch.full((2,), 0.5),
        "img_ids": image_ids(16),
        "txt_ids": text_ids(8),
    }
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    run, plain = subject.compiled_runner(inputs), subject.runner(inputs)
    with torch.no_grad():
        expected = {mode: plain(mode) for mode in (False, True)}
        first = {mode: run(mode) for mode in (False, True)}
        with torch._dynamo.config.patch(error_on_recompile=True):
            again = [run(mode) for mode in (False, True, False, True)]
    assert all(torch.equal(first[mode], expected[mode]) for mode in (False, True))
    assert all(torch.equal(out, first[i % 2 == 1]) for i, out in enumerate(again))
    twins = subject._twins
    assert (
        twins[False] is not subject.model
        and twins[True].transformer_blocks[0] is not subject.model.transformer_blocks[0]
    )
    assert all(a is b for a, b in zip(twins[True].parameters(), subject.model.parameters(), strict=True))
    assert getattr(twins[True], "_flux2_fused_handle", None) is not None
    assert getattr(twins[False], "_flux2_fused_handle", None) is None
