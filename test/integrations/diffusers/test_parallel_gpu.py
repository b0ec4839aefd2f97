"""The patch under diffusers' parallel plans on two GPUs (NCCL), through the benchmark's own job:
`flux2-fused bench --parallel PLAN` starts torchrun, every rank builds klein-4B, and the fused output
must equal diffusers' under the same plan on every rank, with every site fused on every rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flux2_fused.models.flux2 import Flux2Config

from ...conftest import fused_sites

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("plan", ["ulysses=2", "ring=2", "tp=2"])
def test_two_gpu_plans_equal_diffusers_and_fuse_every_site(plan: str, tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    report = tmp_path / "parallel.json"
    args = ["bench", "--parallel", plan, "--config", "klein-4b", "--steps", "2", "--json", str(report)]
    done = subprocess.run([sys.executable, "-m", "flux2_fused", *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["bit_exact"] and result["world"] == 2
    config = Flux2Config.preset("klein-4b")
    expected = fused_sites(config.num_layers, config.num_single_layers)  # every site, as on one GPU
    assert result["single_fused_launches"] == expected
    assert result["fused_launches_per_rank"] == [expected, expected]
