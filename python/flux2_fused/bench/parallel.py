"""Multi-GPU benchmark: one FLUX.2 transformer step under diffusers' own parallelism, diffusers
alone vs `enable()`, on every rank of a torchrun job.

    flux2-fused bench --parallel ulysses=2 [--config dev] [--steps N] [--json FILE]
    torchrun --nproc-per-node 2 -m flux2_fused bench --parallel ulysses=2 ...   (the same, launched)

`--parallel` takes degrees joined by commas: `ulysses=N`, `ring=N` (context parallelism, both may be
given) or `tp=N` (tensor parallelism; diffusers 0.42 builds one device mesh, so not together with
context parallelism). The job has one process per GPU, as many as the degrees multiply to; without
torchrun around it the command starts torchrun itself.

Every rank builds the same diffusers transformer (the package's random weights, `--seed`) and the
same inputs. Rank 0 first times the step alone on its GPU (the single-GPU reference: diffusers vs
fused), then every rank applies the plan (`enable_parallelism`) and the step is timed under it, the
two modes interleaved step by step, the steps enqueued back to back (pipelined, as a denoise loop
runs them). Reported: each mode's median step time (the slowest rank's), the fused gain under the
plan next to the single-GPU gain, the scaling of the fused step over the single-GPU fused step,
whether the fused output equals diffusers' under the same plan on every rank (the output is gathered
by the plan's own hook), how the parallel output compares with the single-GPU one bit for bit (GEMMs
over fewer rows may round differently), and the fused kernels launched per rank.
"""

from __future__ import annotations

import datetime
import functools
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import BadValue
from ..models.flux2 import Flux2Config, Flux2Transformer, image_ids, text_ids
from . import hosts
from .results.parallel import ParallelResult
from .results.tables import Breakdown
from .step import kernel_breakdown, tensor_sha256, time_pipelined

DEGREES = ("ulysses", "ring", "tp")


@dataclass(frozen=True)
class Plan:
    """How the ranks share the work: context-parallel degrees (Ulysses all-to-all, ring) and the
    tensor-parallel degree; the job has `world` ranks."""

    ulysses: int = 1
    ring: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return self.ulysses * self.ring * self.tp

    @property
    def label(self) -> str:
        return ",".join(f"{name}={getattr(self, name)}" for name in DEGREES if getattr(self, name) > 1)

    def diffusers_config(self) -> object:
        """The plan as the config `enable_parallelism` takes."""
        from diffusers import ContextParallelConfig, TensorParallelConfig

        if self.tp > 1:
            return TensorParallelConfig(tp_degree=self.tp)
        return ContextParallelConfig(ulysses_degree=self.ulysses, ring_degree=self.ring)


def parse_plan(text: str) -> Plan:
    """`ulysses=2`, `ring=2`, `ulysses=2,ring=2`, `tp=2` -> Plan; BadValue (exit 2) otherwise."""
    degrees: dict[str, int] = {}
    for part in text.split(","):
        name, _, value = part.strip().partition("=")
        if name not in DEGREES or not value.isdigit() or int(value) < 1 or name in degrees:
            raise BadValue(
                f"--parallel {text!r}: expected degrees like ulysses=2, ring=2, ulysses=2,ring=2 or tp=2 "
                f"(names: {', '.join(DEGREES)}; each once, a whole number >= 1)"
            )
        degrees[name] = int(value)
    plan = Plan(**degrees)
    if plan.world < 2:
        raise BadValue(f"--parallel {text!r}: the degrees multiply to 1, which is one GPU (use `step`)")
    if plan.tp > 1 and plan.ulysses * plan.ring > 1:
        raise BadValue(
            f"--parallel {text!r}: tensor and context parallelism together are not supported by "
            "diffusers' enable_parallelism (one device mesh); give one of them"
        )
    return plan


@dataclass(frozen=True)
class ParallelRequest:
    """What every rank runs: the preset, the step's shape, the timed pairs, the seed, the dtype, and
    diffusers' attention backend (None: `default_backend(plan)`)."""

    config: str = "klein-4b"
    img_tokens: int = 4096
    txt_tokens: int = 512
    batch: int = 1
    steps: int = 10
    seed: int = 0
    dtype: torch.dtype = torch.bfloat16
    backend: str | None = None


def default_backend(plan: Plan) -> str:
    """Native SDPA, diffusers' default, except under ring attention: its passes merge partial results
    by their log-sum-exp, which native SDPA does not return in diffusers 0.42, so ring takes cuDNN's."""
    return "_native_cudnn" if plan.ring > 1 else "native"


def step_inputs(request: ParallelRequest, config: Flux2Config, device: torch.device) -> dict:
    """One step's inputs, the same on every rank (drawn on the CPU from the seed). The ids are batched
    [B, S, 4], as diffusers' pipelines pass them: the plan's input split only cuts 3-D tensors."""
    gen = torch.Generator().manual_seed(request.seed + 1)
    b, n, t = request.batch, request.img_tokens, request.txt_tokens
    inputs = {
        "hidden_states": torch.randn(b, n, config.in_channels, generator=gen),
        "encoder_hidden_states": torch.randn(b, t, config.joint_attention_dim, generator=gen),
        "timestep": torch.full((b,), 0.5),
        "img_ids": image_ids(n).expand(b, -1, -1),
        "txt_ids": text_ids(t).expand(b, -1, -1),
        "guidance": torch.full((b,), 4.0) if config.guidance_embeds else None,
    }
    dtypes = {"hidden_states": request.dtype, "encoder_hidden_states": request.dtype}
    return {
        k: None if v is None else v.to(device=device, dtype=dtypes.get(k, v.dtype)) for k, v in inputs.items()
    }


@dataclass
class Measured:
    """One setup's two modes on this rank: median step ms, the outputs and one profiled step, by mode."""

    ms: dict[bool, float]
    outputs: dict[bool, torch.Tensor]
    profiles: dict[bool, Breakdown]

    @property
    def fused_launches(self) -> int:
        return self.profiles[True].launches["fused"]


def measure(model: torch.nn.Module, inputs: dict, pairs: int) -> Measured:
    """diffusers alone (False) vs `enable()` (True) on one model, interleaved step by step. A warm-up
    step of each first (the fused one builds and self-checks the kernels); under a parallel plan every
    rank must call this together (each step is collective)."""

    def run(fused: bool) -> torch.Tensor:
        hosts.use_fused(model, fused)
        return model(**inputs, return_dict=False)[0]

    with torch.inference_mode():
        outputs = {mode: run(mode) for mode in (False, True)}
        times = time_pipelined(run, pairs)
        profiles = {mode: kernel_breakdown(functools.partial(run, mode)) for mode in (False, True)}
    hosts.use_fused(model, False)
    return Measured({mode: statistics.median(t) for mode, t in times.items()}, outputs, profiles)


def _gathered(value: object) -> list:
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def run_rank(request: ParallelRequest, plan: Plan, device: torch.device) -> ParallelResult | None:
    """This rank's part of the benchmark (the process group is up, one rank a device); rank 0 returns
    the result, the other ranks None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != plan.world:
        raise BadValue(f"--parallel {plan.label} needs {plan.world} processes, this job has {world}")
    config = Flux2Config.preset(request.config)
    ours = Flux2Transformer.random(config, seed=request.seed, device=device, dtype=request.dtype)
    model = hosts.diffusers_model(ours).eval()
    del ours
    backend = request.backend or default_backend(plan)
    model.set_attention_backend(backend)
    inputs = step_inputs(request, config, device)
    checksum = float(sum(p.float().sum() for p in list(model.parameters())[:4]))
    if len(set(_gathered(checksum))) != 1:  # seeded draws are the same on every GPU; say so if not
        raise RuntimeError("the ranks built different random weights from the same seed")
    single = measure(model, inputs, request.steps) if rank == 0 else None
    dist.barrier()
    model.enable_parallelism(config=plan.diffusers_config())
    parallel = measure(model, inputs, request.steps)
    exact = _gathered(torch.equal(parallel.outputs[True], parallel.outputs[False]))
    ms = _gathered(parallel.ms)
    launches = _gathered(parallel.fused_launches)
    if rank != 0:
        return None
    plain, single_plain = parallel.outputs[False], single.outputs[False]
    same_shape = plain.shape == single_plain.shape
    differing = int((plain != single_plain).sum()) if same_shape else plain.numel()
    return ParallelResult(
        config=request.config,
        plan=plan.label,
        backend=backend,
        world=world,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        batch=request.batch,
        img_tokens=request.img_tokens,
        txt_tokens=request.txt_tokens,
        steps=request.steps,
        single_diffusers_ms=single.ms[False],
        single_fused_ms=single.ms[True],
        diffusers_ms=max(m[False] for m in ms),
        fused_ms=max(m[True] for m in ms),
        bit_exact=all(exact),
        single_bit_exact=torch.equal(single.outputs[True], single_plain),
        fused_launches_per_rank=launches,
        single_fused_launches=single.fused_launches,
        differs_from_single=differing,
        max_abs_diff_from_single=(
            float((plain.float() - single_plain.float()).abs().max())
            if differing and same_shape
            else float("nan")
        ),
        diffusers_sha256=tensor_sha256(plain),
        fused_sha256=tensor_sha256(parallel.outputs[True]),
        diffusers_profile=parallel.profiles[False],
        fused_profile=parallel.profiles[True],
    )


def torchrun_command(world: int, argv: list[str]) -> list[str]:
    """The command that reruns this one under torchrun, one process a GPU."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        "-m",
        "flux2_fused",
        *argv,
    ]


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def use_local_device() -> torch.device:
    """Make this rank's GPU (torchrun's LOCAL_RANK) the current one, before anything touches CUDA, so
    no rank opens a context on another rank's GPU."""
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    return device


def run_job(request: ParallelRequest, plan: Plan, report: Callable[[ParallelResult], None]) -> int:
    """This process's rank of a torchrun job on CUDA (NCCL): rank 0 hands the result to `report`.
    1 when the fused output differs from diffusers' under the plan on any rank."""
    device = use_local_device()
    # Long enough for the other ranks to wait out rank 0's single-GPU phase (kernel builds included).
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=30))
    try:
        result = run_rank(request, plan, device)
        exact = _gathered(result is None or (result.bit_exact and result.single_bit_exact))
    finally:
        dist.destroy_process_group()
    if result is not None:
        report(result)
    return 0 if all(exact) else 1
