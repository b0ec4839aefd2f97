"""The multi-GPU benchmark's CPU-side parts: the plan, the inputs every rank draws, the relaunch
command and the table. Its GPU job runs in test/integrations/diffusers/test_parallel_gpu.py."""

from __future__ import annotations

import sys

import pytest
import torch

from flux2_fused.bench import parallel
from flux2_fused.bench.results.parallel import ParallelResult, format_parallel_table
from flux2_fused.bench.step import breakdown_of
from flux2_fused.errors import BadValue
from flux2_fused.models.flux2 import Flux2Config


@pytest.mark.parametrize(
    ("text", "plan", "label"),
    [
        ("ulysses=2", parallel.Plan(ulysses=2), "ulysses=2"),
        ("ring=4", parallel.Plan(ring=4), "ring=4"),
        ("ring=2, ulysses=2", parallel.Plan(ulysses=2, ring=2), "ulysses=2,ring=2"),
        ("tp=2", parallel.Plan(tp=2), "tp=2"),
    ],
)
def test_plans_parse(text: str, plan: parallel.Plan, label: str) -> None:
    parsed = parallel.parse_plan(text)
    assert parsed == plan and parsed.label == label and parsed.world == plan.ulysses * plan.ring * plan.tp


@pytest.mark.parametrize(
    "text", ["", "ulysses", "ulysses=0", "ulysses=x", "ulysses=2,ulysses=2", "sp=2", "tp=1"]
)
def test_bad_plans_are_refused(text: str) -> None:
    with pytest.raises(BadValue):
        parallel.parse_plan(text)


def test_ring_takes_an_attention_backend_that_returns_the_log_sum_exp() -> None:
    assert parallel.default_backend(parallel.Plan(ring=2)) == "_native_cudnn"
    assert parallel.default_backend(parallel.Plan(ulysses=2)) == "native"
    assert parallel.default_backend(parallel.Plan(tp=2)) == "native"


def test_diffusers_configs() -> None:
    diffusers = pytest.importorskip("diffusers")
    cp = parallel.Plan(ulysses=2, ring=2).diffusers_config()
    assert isinstance(cp, diffusers.ContextParallelConfig) and (cp.ulysses_degree, cp.ring_degree) == (2, 2)
    tp = parallel.Plan(tp=2).diffusers_config()
    assert isinstance(tp, diffusers.TensorParallelConfig) and tp.tp_degree == 2


def test_every_rank_draws_the_same_inputs_with_batched_ids() -> None:
    """The plan's input hook splits only 3-D tensors: the ids must be [B, S, 4] to be split."""
    request = parallel.ParallelRequest(
        config="tiny", img_tokens=24, txt_tokens=8, batch=2, dtype=torch.float32
    )
    config = Flux2Config.preset("tiny")
    first, second = (parallel.step_inputs(request, config, torch.device("cpu")) for _ in range(2))
    for name, value in first.items():
        assert (value is None and second[name] is None) or torch.equal(value, second[name])
    assert first["img_ids"].shape == (2, 24, 4) and first["txt_ids"].shape == (2, 8, 4)


def test_the_relaunch_runs_the_same_command_under_torchrun() -> None:
    command = parallel.torchrun_command(2, ["bench", "--parallel", "ulysses=2"])
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in command and command[-5:] == [
        "-m",
        "flux2_fused",
        "bench",
        "--parallel",
        "ulysses=2",
    ]


def test_table() -> None:
    result = ParallelResult(
        config="dev",
        plan="ulysses=2",
        backend="native",
        world=2,
        device="GPU",
        batch=1,
        img_tokens=4096,
        txt_tokens=512,
        steps=4,
        single_diffusers_ms=540.0,
        single_fused_ms=440.0,
        diffusers_ms=300.0,
        fused_ms=240.0,
        bit_exact=True,
        single_bit_exact=True,
        fused_launches_per_rank=[201, 201],
        single_fused_launches=201,
        differs_from_single=0,
        max_abs_diff_from_single=0.0,
        diffusers_sha256="a",
        fused_sha256="a",
        diffusers_profile=breakdown_of([("ampere_bf16_gemm", 1000.0), ("ncclDevKernel_SendRecv", 500.0)]),
        fused_profile=breakdown_of([("gated_resnorm_kernel<4>", 250.0), ("ncclDevKernel_SendRecv", 500.0)]),
    )
    table = format_parallel_table(result, "2.11")
    assert "| ulysses=2 (2 GPUs) | 300.0 | 240.0 | 1.250x | 1.83x | 201 / 201 | yes |" in table
    assert "| 1 GPU | 540.0 | 440.0 | 1.227x | 1.00x | 201 | yes |" in table
    assert "bit-identical to one GPU" in table
    assert "| diffusers | 2 | 1.00 (1) | 0.00 (0) | 0.00 (0) | 0.50 (1) | 0.00 (0) | 1.50 |" in table
    assert "| fused | 2 | 0.00 (0) | 0.00 (0) | 0.25 (1) | 0.50 (1) | 0.00 (0) | 0.75 |" in table
