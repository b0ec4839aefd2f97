"""Whole-transformer benchmark: one denoise step (one forward) at 1024x1024, eager vs fused.

    flux2-fused step [--configs dev klein-4b] [--steps N] [--compile] [--json FILE]
                     [--host package|diffusers] [--lora R] [--offload none|model|group]
                     [--quantize none|float8-row|float8-tensor|int8]

Random weights built on the GPU; the same model runs with `fused = False` and `fused = True` on the
same inputs, interleaved step by step, after a warm-up step of each (the fused one self-checks).
With --host diffusers the model is diffusers' Flux2Transformer2DModel holding the same random
weights (`bench.hosts`), eager is diffusers' own forward and fused is `enable(model)`, switched step
by step; --lora R adds a peft LoRA of rank R, --offload puts its weights on the CPU between uses
(model: accelerate's hook, as `enable_model_cpu_offload`; group: diffusers' block-level group
offloading on a side stream), --quantize applies torchao's dynamic quantization to the blocks'
linears.
Two timings, each of N pairs (CUDA events):
- synchronized: every step starts on an idle GPU and is waited for, so it includes the time the
  GPU spends waiting for the host to launch the step's first kernels;
- pipelined: the steps are enqueued back to back and waited for once at the end, as a denoise loop
  runs them (diffusers' pipelines do not synchronize between steps); with the host ahead of the
  GPU, this is the step's GPU time.
Each reports the median step time per mode, the speedup, the mean of the paired differences with
its 95% confidence interval and how many pairs the fused step won. Also: CUDA kernel launches per
step (torch.profiler), the fused-kernel launches, and the SHA-256 of both outputs (identical when
the fused path is bit-exact). The same profiled step of each mode is split by kernel class (GEMM,
attention, fused, other; `kernel_class`) into kernel time and launches, printed as a second table:
it shows how much of a step the fused ops can touch at all, GEMM and attention being the rest.

With --compile both modes run through `torch.compile(model)` (one compiled graph per mode; on the
diffusers host one compiled module whose forward the switch changes): the compiled tier, where the
fused sites are flux2_fused operators and the fast-path-off graph uses Inductor's own fusion of the
chain. Compiled outputs differ from eager (Inductor is not bit-exact), so there the hashes are
reported, not compared. The compiled tier's gain is small next to the step-to-step spread (klein-4b:
~0.5 ms against a standard deviation of the paired difference of ~1 ms synchronized, ~0.3 ms
pipelined), so --compile defaults to 100 pairs.
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict

import torch
from torch.profiler import ProfilerActivity, profile

from ..errors import BadValue
from ..models.flux2 import Flux2Config, Flux2Transformer, image_ids, text_ids
from . import flux1, hosts
from .options import require_at_least_one
from .report import (
    KERNEL_CLASSES,
    Breakdown,
    StepResult,
    Timing,
    check_output,
    format_step_table,
    write_json,
)
from .timing import event_ms, pipelined_ms

# This package's CUDA kernels, by a part of their names the profiler shows; a new fused op adds its
# kernel here, and both benchmarks (this one and bench/denoise.py) then count it as fused.
FUSED_KERNELS = ("gated_resnorm_kernel", "qk_norm_rope_kernel", "swiglu_kernel", "gelu_tanh_kernel")
# The first pattern that matches a kernel's name gives its class, else "other". Fused comes first so
# our kernels are never counted as anything else, and attention before gemm because the
# memory-efficient SDPA kernels are CUTLASS kernels ("fmha_cutlassF_...").
_KERNEL_CLASS_PATTERNS = (
    ("fused", re.compile("|".join(map(re.escape, FUSED_KERNELS)))),
    ("collective", re.compile(r"nccl", re.IGNORECASE)),
    ("attention", re.compile(r"flash|fmha|cudnn|attention|sdpa", re.IGNORECASE)),
    # gemv: cuBLAS's matrix-vector kernels, which a linear over a single row (batch 1) may run.
    ("gemm", re.compile(r"gemm|gemv|cutlass|xmma|nvjet|cublas", re.IGNORECASE)),
)


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (as stored), so equal hashes mean bit-identical results."""
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def kernel_class(name: str) -> str:
    """The class of a CUDA kernel, by its name: one of report.KERNEL_CLASSES, else other."""
    return next((cls for cls, pattern in _KERNEL_CLASS_PATTERNS if pattern.search(name)), "other")


def breakdown_of(kernels: Iterable[tuple[str, float]]) -> Breakdown:
    """Kernel time (ms) and launches by class of (kernel name, duration in us) pairs; kept apart from
    the profiler so the split can be tested without a GPU."""
    kernel_ms, launches = dict.fromkeys(KERNEL_CLASSES, 0.0), dict.fromkeys(KERNEL_CLASSES, 0)
    for name, us in kernels:
        cls = kernel_class(name)
        kernel_ms[cls] += us / 1e3
        launches[cls] += 1
    return Breakdown(kernel_ms=kernel_ms, launches=launches)


def kernel_breakdown(fn: Callable[[], object]) -> Breakdown:
    """The CUDA kernels (and device memcpy / memset, counted as other) that one call of `fn` runs,
    by class, from torch.profiler: the launch counts and the time split come from the same step."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return breakdown_of((e.name, e.time_range.elapsed_us()) for e in kernels)


def step_inputs(
    config: Flux2Config, batch: int, img_tokens: int, txt_tokens: int, dtype: torch.dtype, seed: int = 1
) -> dict:
    """Random latents and text embeddings from `seed`, with FLUX.2's position ids, on the GPU. Seeded,
    so an output's SHA-256 identifies the computation across runs and code versions."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "hidden_states": torch.randn(
            batch, img_tokens, config.in_channels, device="cuda", dtype=dtype, generator=gen
        ),
        "encoder_hidden_states": torch.randn(
            batch, txt_tokens, config.joint_attention_dim, device="cuda", dtype=dtype, generator=gen
        ),
        "timestep": torch.full((batch,), 0.5, device="cuda"),
        "img_ids": image_ids(img_tokens, device="cuda"),
        "txt_ids": text_ids(txt_tokens, device="cuda"),
        "guidance": torch.full((batch,), 4.0, device="cuda") if config.guidance_embeds else None,
    }


def _pair_order(pairs: int) -> list[bool]:
    """The modes in run order: (eager, fused), then (fused, eager), ..., so drift hits both alike."""
    return [mode for i in range(pairs) for mode in ((False, True) if i % 2 == 0 else (True, False))]


def time_synchronized(
    run: Callable[[bool], object], pairs: int, switch: Callable[[bool], object] | None = None
) -> dict[bool, list[float]]:
    """Each step alone from an idle GPU (synchronized after every step): includes the time the GPU
    waits for the host to launch the step's first kernels. `switch(mode)`, where given, sets the mode
    before the step's timing starts (the diffusers host's enable() or disable(), host work that is
    not the step's), so `run` finds the mode already set."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for mode in _pair_order(pairs):
        if switch is not None:
            switch(mode)
        times[mode].append(event_ms(functools.partial(run, mode))[1])
    return times


def time_pipelined(run: Callable[[bool], object], pairs: int) -> dict[bool, list[float]]:
    """Eager and fused steps pipelined (`timing.pipelined_ms`), in `_pair_order`."""
    return pipelined_ms(run, _pair_order(pairs))


def _package_run(config: Flux2Config, inputs: dict, compiled: bool) -> Callable[[bool], torch.Tensor]:
    """One step of the package's model in either mode (`model.fused`, free to set), compiled or not."""
    model = Flux2Transformer.random(config, seed=0, device="cuda", dtype=torch.bfloat16)
    forward = torch.compile(model) if compiled else model

    def run(fused: bool) -> torch.Tensor:
        model.fused = fused
        return forward(**inputs)

    return run


def _diffusers_run(
    config: Flux2Config | str,
    inputs: dict,
    lora_rank: int | None,
    offload: str,
    quantization: str = "none",
    compiled: bool = False,
) -> tuple[Callable[[bool], torch.Tensor], Callable[[bool], None]]:
    """One step of diffusers' model with the same random weights, its own forward or enable()'s, and
    the switch between the two (for time_synchronized to call outside the timing); `config` a FLUX.1
    size's name builds FLUX.1's transformer (`bench.flux1`). Compiled, the one
    `torch.compile(model)` holds a graph for each mode (the switch changes the forward it traces)."""
    device = torch.device("cuda", torch.cuda.current_device())
    if isinstance(config, str):  # a FLUX.1 size: diffusers' own transformer with its default init
        model = hosts.set_up(
            flux1.random_transformer(config, device, torch.bfloat16),
            device,
            lora_rank,
            offload,
            quantization,
            flux1.LORA_TARGETS,
        )
    else:
        model = hosts.diffusers_host(
            config, device, torch.bfloat16, lora_rank, offload, quantization=quantization
        )
    switch = functools.partial(hosts.use_fused, model)
    forward = torch.compile(model) if compiled else model

    def run(fused: bool) -> torch.Tensor:
        switch(fused)
        return forward(**inputs, return_dict=False)[0]

    return run, switch


def bench_config(
    name: str,
    steps: int,
    batch: int,
    img_tokens: int,
    txt_tokens: int,
    compiled: bool = False,
    host: str = "package",
    lora_rank: int | None = None,
    offload: str = "none",
    quantization: str = "none",
) -> StepResult:
    switch = None
    if flux1.is_flux1(name):
        inputs = flux1.step_inputs(name, batch, img_tokens, txt_tokens, torch.bfloat16)
        run, switch = _diffusers_run(name, inputs, lora_rank, offload, quantization, compiled)
    elif host == "diffusers":
        config = Flux2Config.preset(name)
        inputs = step_inputs(config, batch, img_tokens, txt_tokens, torch.bfloat16)
        run, switch = _diffusers_run(config, inputs, lora_rank, offload, quantization, compiled)
    else:
        config = Flux2Config.preset(name)
        inputs = step_inputs(config, batch, img_tokens, txt_tokens, torch.bfloat16)
        run = _package_run(config, inputs, compiled)

    with torch.inference_mode():
        outputs = {mode: run(mode) for mode in (False, True)}  # warm-up; the fused one self-checks
        synchronized = Timing.of(time_synchronized(run, steps, switch))
        pipelined = Timing.of(time_pipelined(run, steps))
        eager_profile = kernel_breakdown(lambda: run(False))
        fused_profile = kernel_breakdown(lambda: run(True))
    return StepResult(
        config=name,
        batch=batch,
        steps=steps,
        img_tokens=img_tokens,
        txt_tokens=txt_tokens,
        synchronized=synchronized,
        pipelined=pipelined,
        eager_kernels=eager_profile.total_launches,
        fused_kernels=fused_profile.total_launches,
        fused_kernel_launches=fused_profile.launches["fused"],
        eager_profile=eager_profile,
        fused_profile=fused_profile,
        eager_sha256=tensor_sha256(outputs[False]),
        fused_sha256=tensor_sha256(outputs[True]),
        bit_exact=torch.equal(outputs[False], outputs[True]),
        compiled=compiled,
        host=host,
        lora_rank=lora_rank,
        offload=offload,
        quantization=quantization,
    )


def check(args: argparse.Namespace) -> None:
    """Refuse, before any work, options that do not go together or that this environment cannot run
    (BadValue: one line, exit status 2)."""
    check_output("--json", args.json)
    require_at_least_one(
        {
            "--steps": args.steps,
            "--batch": args.batch,
            "--img-tokens": args.img_tokens,
            "--txt-tokens": args.txt_tokens,
            "--lora": args.lora,
        }
    )
    if args.host == "package":
        flux1_configs = [name for name in args.configs if flux1.is_flux1(name)]
        if flux1_configs:
            names = ", ".join(flux1_configs)
            raise BadValue(f"{names}: FLUX.1 runs on --host diffusers (it has no package model)")
        if args.lora is not None or args.offload != "none" or args.quantize != "none":
            raise BadValue("--lora, --offload and --quantize apply to --host diffusers")
        return
    if args.compile and (args.lora is not None or args.offload != "none"):
        raise BadValue("--compile on --host diffusers takes --quantize, not --lora or --offload")
    hosts.check_diffusers_host("--host diffusers", args.lora, args.offload, args.quantize)


def run(args: argparse.Namespace) -> int:
    """Benchmark every config on the current CUDA GPU and print the table; 1 when a fused step's
    output differs from eager's (not checked under --compile, where neither mode is bit-exact)."""
    results = []
    steps = args.steps or (100 if args.compile else 7)
    for name in args.configs:
        results.append(
            bench_config(
                name,
                steps,
                args.batch,
                args.img_tokens,
                args.txt_tokens,
                compiled=args.compile,
                host=args.host,
                lora_rank=args.lora,
                offload=args.offload,
                quantization=args.quantize,
            )
        )
        gc.collect()  # drop the previous model (dev is 64 GB) before building the next
        torch.cuda.empty_cache()
    print(format_step_table(results, torch.cuda.get_device_name(), torch.__version__))
    if args.json:
        write_json([asdict(r) for r in results], args.json)
    return 0 if args.compile or all(r.bit_exact for r in results) else 1
