"""The patch under diffusers' context parallelism, on the CPU: two gloo processes, the tiny config.

diffusers 0.42's `enable_parallelism` needs an accelerator (it divides by
`torch.accelerator.device_count()`, 0 on a CPU-only machine), so each process reports one device
to it; nothing else is changed. Ulysses attention then runs on gloo as on NCCL: the plan's
hook splits the inputs, each block's attention exchanges rows inside diffusers' dispatch, the
output projection's hook gathers. The GPU runs (NCCL, klein-4B and dev) are `flux2-fused bench
--parallel` (bench/parallel.py) and test_parallel_gpu.py.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flux2_fused.bench import hosts
from flux2_fused.bench.parallel import ParallelRequest, parse_plan, step_inputs
from flux2_fused.integrations import diffusers as integration
from flux2_fused.models.flux2 import Flux2Config, Flux2Transformer
from flux2_fused.models.flux2 import blocks as flux2_blocks

pytest.importorskip("diffusers")

# Ring attention needs a backend that returns the log-sum-exp (cuDNN, flash); native SDPA, the one
# backend on a CPU, does not, so ring runs on the GPU only.
CASES = [("ulysses=2", order) for order in ("enable first", "plan first")]


def _worker(rank: int, port: int, results: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.accelerator.device_count = lambda: 1  # see the module docstring
    request = ParallelRequest(config="tiny", img_tokens=36, txt_tokens=12, batch=2, dtype=torch.float32)
    config = Flux2Config.preset("tiny")
    blocks = []
    flux2_blocks.double_block_body = _counted(flux2_blocks.double_block_body, blocks)
    try:
        for plan, order in CASES:
            model = hosts.diffusers_model(Flux2Transformer.random(config, seed=5)).eval()
            inputs = step_inputs(request, config, torch.device("cpu"))
            with torch.inference_mode():
                single = model(**inputs, return_dict=False)[0]
                handle = integration.enable(model) if order == "enable first" else None
                model.enable_parallelism(config=parse_plan(plan).diffusers_config())
                handle = handle or integration.enable(model)
                blocks.clear()
                fused = model(**inputs, return_dict=False)[0]
                fused_blocks = len(blocks)
                handle.disable()
                plain = model(**inputs, return_dict=False)[0]
            full = fused.shape == single.shape
            results.put((rank, plan, order, torch.equal(fused, plain), fused_blocks, full))
    finally:
        dist.destroy_process_group()


def _counted(fn, calls: list):
    def wrapper(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapper


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_context_parallel_on_two_gloo_ranks_equals_diffusers() -> None:
    """Ulysses, `enable()` before or after `enable_parallelism`: on both ranks the fused
    forward runs every block (the block code, with attention through diffusers' dispatch), its
    output equals diffusers' under the same plan, and the plan's gather gives the full sequence."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(_free_port(), results), nprocs=2, start_method="spawn")
    rows = [results.get() for _ in range(2 * len(CASES))]
    layers = Flux2Config.preset("tiny").num_layers
    assert sorted((r[0], r[1], r[2]) for r in rows) == sorted((k, *c) for k in range(2) for c in CASES)
    for rank, plan, order, equal, blocks, full in rows:
        assert equal and full, (rank, plan, order)
        assert blocks == layers, (rank, plan, order, blocks)
