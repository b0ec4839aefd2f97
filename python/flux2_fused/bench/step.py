"""Whole-transformer benchmark: one denoise step (one forward), eager vs fused, at each size and batch.

    flux2-fused step [--configs dev klein-4b] [--sizes WxH ...] [--batch N ...] [--steps N]
                     [--compile | --vs-compile [eager|both] --graph --floor]
                     [--json FILE] [--plot FILE.png]
                     [--host package|diffusers] [--lora R] [--offload none|model|group]
                     [--quantize none|float8-row|float8-tensor|int8]

A scan: each config's model is built once, then every batch size at every image size (default one
batch of 1024x1024; `--img-tokens N` for a token count instead of a size) is one row.

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
attention, fused, other; `classify.kernel_class`) into kernel time and launches, printed as a
second table: it shows how much of a step the fused ops can touch at all, GEMM and attention being
the rest. Its fused row adds the GB the fused kernels' launches move in one step (`bench.traffic`)
and their bandwidth in the step (those bytes over their profiled time) as a share of the GPU's copy
bandwidth, measured in the same run.

Each mode's GPU busy % comes from a few pipelined steps under torch.profiler (`pipelined_busy_pct`):
the share of their span the GPU spent in a kernel, copy or memset; below 100 it waited for the host.
Its host ms is the CPU time Python takes to issue one step (`host_ms`): where it reaches the
pipelined step time, the host, not the GPU, sets the pace.
With --vs-compile a third mode, `torch.compile(model)` running the eager forward, takes turns with
eager and fused in the pipelined timing: the three in one run, reported as the compiled step's
median, its paired difference from the fused step (each round's two steps a pair, as eager's) with
its 95% confidence interval, and the compiled output's hash; `--vs-compile both` adds a fourth, the
compiled fused forward (its sites flux2_fused operators).
--graph adds the fused step replayed from a CUDA graph (its output compared with eager's), --floor
the step's GEMM and attention calls alone, replayed from a CUDA graph (`bench.floor`): the time an
exact step can at best reach under the same clocks, each in turn with the rest (with --quantize
float8-row or float8-tensor the FP8 floor: torchao's scaled GEMMs, without the activations'
quantization), and the copied step: those calls with each fused launch replayed as one device copy
of the bytes it moves, in its place: how the fused kernels' traffic compares in the step with the
copy the kernel benchmark holds each kernel against.
--plot draws the pipelined step time of each mode against size, a panel a config.

With --compile both modes run through `torch.compile(model)` (one compiled graph per mode; on the
diffusers host two models sharing the weights, one of them enabled, each compiled: see
`Subject.compiled_runner`): the compiled tier, where the
fused sites are flux2_fused operators and the fast-path-off graph uses Inductor's own fusion of the
chain. Compiled outputs differ from eager (Inductor is not bit-exact), so there the hashes are
reported, not compared. The compiled tier's gain is small next to the step-to-step spread (klein-4b:
~0.5 ms against a standard deviation of the paired difference of ~1 ms synchronized, ~0.3 ms
pipelined), so --compile defaults to 100 pairs.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import hashlib
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from ..errors import BadValue, CommandError
from ..models.flux2 import Flux2Config, Flux2Transformer, image_ids, text_ids
from ..models.flux2.model import folder_config
from . import comfyui, flux1, flux3, hosts, qwenimage, zimage
from .classify import fused_op, tally
from .floor import floor_step
from .options import PX_PER_TOKEN, check_output, diffusers_only, no_package_model, require_at_least_one
from .results.step import OpTraffic, StepResult, format_step_table
from .results.tables import KERNEL_CLASSES, Breakdown, Paired, Timing, write_json
from .timing import copy_bandwidth_gbs, event_ms, graphed, pipelined_ms, rotated_order, without_lead_ins
from .traffic import bytes_by_op


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (as stored), so equal hashes mean bit-identical results."""
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def breakdown_of(kernels: Iterable[tuple[str, float]]) -> Breakdown:
    """Kernel time (ms) and launches by class (results.tables.KERNEL_CLASSES) of (kernel name, duration in
    us) pairs (`classify.tally`)."""
    kernel_ms, launches = tally(kernels, KERNEL_CLASSES)
    return Breakdown(kernel_ms=kernel_ms, launches=launches)


def cuda_events(fn: Callable[[], object]) -> list:
    """The GPU's kernels, copies and memsets that `fn()` runs, as torch.profiler records them
    (waited for before the profile ends)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@functools.cache
def copy_gbs() -> float:
    """The copy bandwidth the fused kernels' traffic is set against: measured once a process, on
    256 MiB buffers (five times the H200's L2 cache, and small beside any model the step holds).
    `run` measures it first, before any model is built or step timed, as the kernel benchmark
    measures its own. Measured after a FLUX.3 run's timed steps it came out at about 3.7 TB/s,
    against 4.25 at the start of the kernel benchmark's process on the same H200 that day, and the
    kernels' share read 99% where the kernel benchmark puts the same kernels at 70-90%."""
    return copy_bandwidth_gbs(256 << 20)


def kernel_breakdown(fn: Callable[[], object]) -> Breakdown:
    """The CUDA kernels (and device memcpy / memset, counted as other) that one call of `fn` runs,
    by class, from torch.profiler: the launch counts and the time split come from the same step."""
    return breakdown_of(kernel_times(fn))


def kernel_times(fn: Callable[[], object]) -> list[tuple[str, float]]:
    """(name, duration in us) of each GPU kernel, copy and memset of one call of `fn`."""
    return [(e.name, e.time_range.elapsed_us()) for e in cuda_events(fn)]


def op_traffic(kernels: Iterable[tuple[str, float]], moved: dict[str, int]) -> list[OpTraffic]:
    """The fused kernels among `kernels` (name, us) by op (`classify.fused_op`), each with the bytes
    `moved` (op -> bytes, `traffic.bytes_by_op`) says its launches move, in `moved`'s order."""
    ms = dict.fromkeys(moved, 0.0)
    launches = dict.fromkeys(moved, 0)
    for name, us in kernels:
        op = fused_op(name)
        if op is not None:
            ms[op] = ms.get(op, 0.0) + us / 1e3
            launches[op] = launches.get(op, 0) + 1
    return [OpTraffic(op, launches[op], moved.get(op, 0) / 1e9, ms[op]) for op in ms]


def step_inputs(
    config: Flux2Config,
    batch: int,
    img_tokens: int,
    txt_tokens: int,
    dtype: torch.dtype,
    seed: int = 1,
    width_tokens: int | None = None,
) -> dict:
    """Random latents and text embeddings from `seed`, with FLUX.2's position ids of an image
    `width_tokens` wide (default: square), on the GPU. Seeded, so an output's SHA-256 identifies the
    computation across runs and code versions."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "hidden_states": torch.randn(
            batch, img_tokens, config.in_channels, device="cuda", dtype=dtype, generator=gen
        ),
        "encoder_hidden_states": torch.randn(
            batch, txt_tokens, config.joint_attention_dim, device="cuda", dtype=dtype, generator=gen
        ),
        "timestep": torch.full((batch,), 0.5, device="cuda"),
        "img_ids": image_ids(img_tokens, width_tokens, device="cuda"),
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


def busy_pct(intervals: Iterable[tuple[float, float]]) -> float:
    """Percent of the span from the first (start, end) interval's start to the last end that at least
    one interval covers: the GPU's busy share when the intervals are its kernels and copies."""
    spans = sorted(intervals)
    if not spans:
        return 0.0
    first, (start, end) = spans[0][0], spans[0]
    covered = 0.0
    for s, e in spans[1:]:
        if s > end:
            covered += end - start
            start, end = s, e
        else:
            end = max(end, e)
    covered += end - start
    return 100.0 if end <= first else 100 * covered / (end - first)


def pipelined_busy_pct(step: Callable[[], object], steps: int = 5) -> float:
    """GPU busy % of `steps` steps enqueued back to back (after one untimed lead-in, so the host is
    ahead when the profile starts), from torch.profiler's record of every kernel, copy and memset:
    below 100% the GPU waited for the host between them."""
    step()
    events = cuda_events(lambda: [step() for _ in range(steps)])
    return busy_pct((e.time_range.start, e.time_range.end) for e in events)


def host_ms(
    step: Callable[[], object], steps: int = 5, sync: Callable[[], None] = torch.cuda.synchronize
) -> float:
    """Median CPU time (ms) to issue one step: each call starts with the GPU idle (after `sync`) and
    is not waited for, so the figure is the host's work alone (a step that waits for the GPU inside
    counts the wait: then the host cannot run ahead either)."""
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        step()
        times.append(1e3 * (time.perf_counter() - start))
    sync()
    return statistics.median(times)


def sample(out: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """A diffusers transformer's output as one tensor: Z-Image returns a list of per-sample latents,
    stacked here (the same launch in every mode)."""
    return torch.stack(out) if isinstance(out, list) else out


# The benchmark modules of the families diffusers alone hosts: each builds its random transformer and
# a step's inputs, and names its LoRA's target Linears.
DIFFUSERS_FAMILIES = {"FLUX.1": flux1, "FLUX.3": flux3, "Qwen-Image": qwenimage, "Z-Image": zimage}


class Subject:
    """The model the step benchmark times, built once for all its sizes and batches: the package's
    model (eager = `fused = False`) or diffusers' with the same random weights (eager = its own
    forward, fused = `enable(model)`; FLUX.1 and FLUX.3 sizes are diffusers' own transformers with
    their default init, `bench.flux1` and `bench.flux3`), quantized, with a LoRA and offloaded as
    asked."""

    def __init__(
        self,
        name: str,
        host: str,
        lora_rank: int | None,
        offload: str,
        quantization: str,
        weights: Path | None = None,
    ) -> None:
        device = torch.device("cuda", torch.cuda.current_device())
        self.name = name
        self.comfyui = host == "comfyui"
        self.family = None if self.comfyui else DIFFUSERS_FAMILIES.get(diffusers_only(name) or "")
        self.diffusers = self.family is not None or host == "diffusers"
        self._twins: dict[bool, nn.Module] = {}
        if self.comfyui:  # ComfyUI's own model at a FLUX size: eager is its forward, fused enable()'s
            self.params = comfyui.preset_params(name)
            self.model = comfyui.random_model(name, device, torch.bfloat16)
            self.handle = self._enable(self.model)
            return
        if self.family is not None:
            transformer = self.family.random_transformer(name, device, torch.bfloat16)
            self.model = hosts.set_up(
                transformer, device, lora_rank, offload, quantization, self.family.LORA_TARGETS
            )
            return
        # FLUX.2: a preset's random weights, or a weights folder's (`--weights`), on either host.
        if weights is not None:
            ours = Flux2Transformer.from_pretrained(weights, device=device, dtype=torch.bfloat16)
        else:
            ours = Flux2Transformer.random(
                Flux2Config.preset(name), seed=0, device=device, dtype=torch.bfloat16
            )
        self.config = ours.config
        if self.diffusers:
            model = hosts.diffusers_model(ours).eval()
            self.model = hosts.set_up(model, device, lora_rank, offload, quantization)
        else:
            self.model = ours

    def switch(self, fused: bool) -> None:
        """Set the mode: host work outside a step's timing (the diffusers host's enable()/disable())."""
        if self.comfyui:
            self.handle.active = fused
        elif self.diffusers:
            hosts.use_fused(self.model, fused)
        else:
            self.model.fused = fused

    def inputs(
        self,
        batch: int,
        img_tokens: int,
        txt_tokens: int,
        width_tokens: int | None,
        reference_tokens: int = 0,
    ) -> dict:
        if self.family is flux3:
            return flux3.step_inputs(
                self.name,
                batch,
                img_tokens,
                txt_tokens,
                torch.bfloat16,
                width_tokens=width_tokens,
                reference_tokens=reference_tokens,
            )
        if self.family is not None:
            return self.family.step_inputs(
                self.name, batch, img_tokens, txt_tokens, torch.bfloat16, width_tokens=width_tokens
            )
        if self.comfyui:
            return comfyui.step_inputs(
                self.params, batch, img_tokens, txt_tokens, torch.bfloat16, width_tokens=width_tokens
            )
        return step_inputs(
            self.config, batch, img_tokens, txt_tokens, torch.bfloat16, width_tokens=width_tokens
        )

    def runner(self, inputs: dict) -> Callable[[bool], torch.Tensor]:
        """One step in either mode, the mode set by `switch`."""

        def run(fused: bool) -> torch.Tensor:
            self.switch(fused)
            if self.diffusers:
                return sample(self.model(**inputs, return_dict=False)[0])
            return self.model(**inputs)

        return run

    def _enable(self, model: nn.Module) -> Any:
        """The host's enable() on `model` (diffusers' or ComfyUI's), its handle."""
        if self.comfyui:
            from ..integrations.comfyui import enable
        else:
            from ..integrations.diffusers import enable
        return enable(model)

    def compiled_runner(self, inputs: dict) -> Callable[[bool], torch.Tensor]:
        """One step in either mode under torch.compile, for one shape (the compile caches cleared,
        shapes static: each size of a scan gets its own graphs, where automatic dynamic shapes would
        trace a slower symbolic one after the first change and the recompile limit would send later
        sizes to eager). Switching modes must change nothing a graph's guards may check, or a switch
        could recompile: the package's model switches a flag, a guarded attribute (one graph a
        mode); on the diffusers and ComfyUI hosts, where enable() and disable() swap forward objects,
        each mode compiles a model of its own, twins holding the same weight tensors, one enabled
        once, so neither graph's model ever changes."""
        torch._dynamo.reset()
        if not (self.diffusers or self.comfyui):
            forward = torch.compile(self.model, dynamic=False)

            def run_package(fused: bool) -> torch.Tensor:
                self.switch(fused)
                return forward(**inputs)

            return run_package
        forwards: dict[bool, Callable[..., Any]] = {}

        def run(fused: bool) -> torch.Tensor:
            if fused not in forwards:
                forwards[fused] = torch.compile(self._twin(fused), dynamic=False)
            if self.comfyui:
                return forwards[fused](**inputs)
            return sample(forwards[fused](**inputs, return_dict=False)[0])

        return run

    def _twin(self, fused: bool) -> nn.Module:
        """A copy of the host's model whose modules are its own and whose weights and buffers are
        the model's tensors (no copy), plain or with enable() on it; one of each, kept."""
        if fused not in self._twins:
            self.switch(False)  # copy the host's own model, not a patched one
            shared = {id(t): t for t in (*self.model.parameters(), *self.model.buffers())}
            twin = copy.deepcopy(self.model, memo=shared)
            if self.comfyui:  # the copy without the patch it was copied with
                del twin.__dict__["forward_orig"]
            if fused:
                self._enable(twin)
            self._twins[fused] = twin
        return self._twins[fused]


def captured(step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """`step` captured in a CUDA graph (`timing.graphed`), for static shapes: its replay is the step
    without the host's launch work. CommandError where the step cannot be captured (a host sync)."""
    try:
        return graphed(step)
    except RuntimeError as err:
        raise CommandError(f"--graph: the fused step could not be captured in a CUDA graph: {err}") from err


# The quantizations whose floor the recorder captures: torchao's float8 linears reach it as `_scaled_mm`
# (the FP8 floor: the scaled GEMMs and attention, without the activations' quantization).
FLOAT8_FLOORS = ("float8-row", "float8-tensor")


def floor_of(step: Callable[[], torch.Tensor], model: nn.Module, copies: bool = False) -> Callable[[], None]:
    """`bench.floor.floor_step` (with `copies`, its copied step), a CommandError where the step's
    calls cannot be recorded or captured."""
    try:
        return floor_step(step, model, copies)
    except (RuntimeError, ValueError) as err:
        message = f"--floor: the step's GEMM and attention calls could not be replayed: {err}"
        raise CommandError(message) from err


def bench_size(
    subject: Subject,
    steps: int,
    batch: int,
    img_tokens: int,
    txt_tokens: int,
    size: tuple[int, int] | None = None,
    compile_both: bool = False,
    vs_compile: str | None = None,
    graph: bool = False,
    floor: bool = False,
    options: dict[str, Any] | None = None,
    reference_tokens: int = 0,
    block: int = 1,
    lead_in: int = 0,
) -> StepResult:
    """One (batch, size) of a subject: eager and fused interleaved (synchronized, then pipelined,
    in turn with the other modes asked for: torch.compile of the eager forward with `vs_compile`
    "eager", and of the fused one too with "both"; the fused step replayed from a CUDA graph with
    `graph`; its GEMM and attention calls alone with `floor`, `bench.floor`), their kernel
    breakdowns and each mode's GPU busy % and host ms; `size` (width, height) pixels gives `img_tokens` their
    layout; the pipelined modes run in blocks of `block` timed steps, each after `lead_in` untimed
    ones (`timing.without_lead_ins`)."""
    width_tokens = None if size is None else size[0] // PX_PER_TOKEN
    inputs = subject.inputs(batch, img_tokens, txt_tokens, width_tokens, reference_tokens)
    run = subject.compiled_runner(inputs) if compile_both else subject.runner(inputs)
    runs: dict[str, Callable[[], torch.Tensor]] = {
        "eager": functools.partial(run, False),
        "fused": functools.partial(run, True),
    }
    if vs_compile is not None:
        compiled = subject.compiled_runner(inputs)
        runs["compiled"] = functools.partial(compiled, False)
        if vs_compile == "both":
            runs["compiled-fused"] = functools.partial(compiled, True)

    with torch.inference_mode():
        if subject.comfyui:
            # ComfyUI's first forward at a shape in a process gives other bits than its later ones,
            # which agree with each other and with the fused step (H200, comfy-kitchen 0.2.26): the
            # comparison is with ComfyUI's steady state.
            runs["eager"]()
        outputs = {mode: step() for mode, step in runs.items()}  # warm-up; the fused one self-checks
        if graph:
            runs["graph"] = captured(runs["fused"])
            outputs["graph"] = runs["graph"]()
        if floor:
            runs["floor"] = floor_of(runs["fused"], subject.model)
            runs["copied"] = floor_of(runs["fused"], subject.model, copies=True)
        moved = bytes_by_op(runs["fused"])
        # Compiled, each mode's runner sets its own mode (the diffusers host's twins need no switch).
        switch = None if compile_both else subject.switch
        synchronized = Timing.of(time_synchronized(run, steps, switch))
        if len(runs) > 2 or block > 1 or lead_in > 0:
            order = rotated_order(list(runs), steps, block, lead_in)
            times = without_lead_ins(pipelined_ms(lambda mode: runs[mode](), order), block, lead_in)
            pipelined = Timing.of({False: times["eager"], True: times["fused"]})
        else:
            times, pipelined = {}, Timing.of(time_pipelined(run, steps))
        eager_profile = kernel_breakdown(runs["eager"])
        fused_kernels = kernel_times(runs["fused"])
        fused_profile = breakdown_of(fused_kernels)
        floor_profile = kernel_breakdown(runs["floor"]) if floor else None
        copied_profile = kernel_breakdown(runs["copied"]) if floor else None
        busy = {mode: pipelined_busy_pct(step) for mode, step in runs.items()}
        host = {mode: host_ms(step) for mode, step in runs.items()}

    def median(mode: str) -> float | None:
        return statistics.median(times[mode]) if mode in times else None

    # Each compiled step against the fused step of its round: the same drift-cancelling pairs as
    # eager's, so the compile column gets an interval, not only a median.
    vs_compiled = Paired.of(times["compiled"], times["fused"]) if "compiled" in times else None

    def sha256(mode: str) -> str | None:
        return tensor_sha256(outputs[mode]) if mode in outputs else None

    return StepResult(
        config=subject.name,
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
        eager_sha256=tensor_sha256(outputs["eager"]),
        fused_sha256=tensor_sha256(outputs["fused"]),
        bit_exact=torch.equal(outputs["eager"], outputs["fused"]),
        compiled=compile_both,
        width=None if size is None else size[0],
        height=None if size is None else size[1],
        busy_pct=busy,
        host_ms=host,
        compiled_ms=median("compiled"),
        compiled_vs_fused=vs_compiled,
        compiled_sha256=sha256("compiled"),
        compiled_fused_ms=median("compiled-fused"),
        compiled_fused_sha256=sha256("compiled-fused"),
        graph_ms=median("graph"),
        graph_bit_exact=torch.equal(outputs["graph"], outputs["eager"]) if graph else None,
        floor_ms=median("floor"),
        floor_profile=floor_profile,
        copied_ms=median("copied"),
        copied_profile=copied_profile,
        fused_gb=sum(moved.values()) / 1e9,
        fused_ops=op_traffic(fused_kernels, moved),
        copy_gbs=copy_gbs(),
        reference_tokens=reference_tokens,
        block=block,
        lead_in=lead_in,
        **(options or {}),
    )


def check(args: argparse.Namespace) -> None:
    """Refuse, before any work, options that do not go together or that this environment cannot run
    (BadValue: one line, exit status 2)."""
    check_output("--json", args.json)
    check_output("--plot", args.plot, ".png")
    if args.plot is not None:
        from . import plot  # only where a plot is asked for (see bench/plot.py)

        plot.require_matplotlib()
    require_at_least_one(
        {
            "--steps": args.steps,
            "--batch": min(args.batch),
            "--img-tokens": args.img_tokens,
            "--text-tokens": args.txt_tokens,
            "--lora": args.lora,
            "--block": args.block,
        }
    )
    if args.lead_in < 0:
        raise BadValue(f"--lead-in must be at least 0, got {args.lead_in}")
    if args.weights is not None:
        folder_config(args.weights)  # a folder that is not a FLUX.2 transformer fails here, in one line
    if args.reference_tokens < 0:
        raise BadValue(f"--reference-tokens must be at least 0, got {args.reference_tokens}")
    if args.reference_tokens and (others := [n for n in args.configs if diffusers_only(n) != "FLUX.3"]):
        raise BadValue(f"--reference-tokens: reference images are FLUX.3's, not {', '.join(others)}'s")
    if args.compile and (args.vs_compile or args.graph or args.floor):
        raise BadValue(
            "--compile compiles both modes; --vs-compile, --graph and --floor add modes to eager and fused"
        )
    if args.host == "comfyui":
        comfyui.check_options(args)
        return
    if args.host == "package":
        if (why := no_package_model(args.configs)) is not None:
            raise BadValue(f"{why}; run it with --host diffusers")
        if args.lora is not None or args.offload != "none" or args.quantize != "none":
            raise BadValue("--lora, --offload and --quantize apply to --host diffusers")
        return
    if args.floor and args.quantize not in ("none", *FLOAT8_FLOORS):
        raise BadValue(f"--floor takes plain or float8 linears: not --quantize {args.quantize}")
    if (args.graph or args.floor) and args.offload != "none":
        raise BadValue(
            "--graph and --floor capture a step on the GPU: without --offload, which moves weights in it"
        )
    if (args.compile or args.vs_compile) and (args.lora is not None or args.offload != "none"):
        raise BadValue(
            "--compile and --vs-compile on --host diffusers take --quantize, not --lora or --offload"
        )
    hosts.check_diffusers_host("--host diffusers", args.lora, args.offload, args.quantize)


def shapes(args: argparse.Namespace) -> list[tuple[int, tuple[int, int] | None]]:
    """The (image tokens, (width, height) pixels or None) each run of the options takes: --sizes, or
    --img-tokens (square), or 1024x1024."""
    if args.img_tokens is not None:
        return [(args.img_tokens, None)]
    sizes = args.sizes or [(1024, 1024)]
    return [((w // PX_PER_TOKEN) * (h // PX_PER_TOKEN), (w, h)) for w, h in sizes]


def run(args: argparse.Namespace) -> int:
    """Benchmark every config at every batch and size on the current CUDA GPU (each model built once)
    and print the table; 1 when a fused step's output (or its CUDA graph's replay) differs from
    eager's (not checked under --compile, where neither mode is bit-exact)."""
    copy_gbs()  # before the models heat the GPU (see copy_gbs)
    results = []
    steps = args.steps or (100 if args.compile else 7)
    options = {
        "host": args.host,
        "lora_rank": args.lora,
        "offload": args.offload,
        "quantization": args.quantize,
    }
    names = args.configs if args.weights is None else [args.weights.name]
    for name in names:
        subject = Subject(name, args.host, args.lora, args.offload, args.quantize, args.weights)
        for batch in args.batch:
            for img_tokens, size in shapes(args):
                result = bench_size(
                    subject,
                    steps,
                    batch,
                    img_tokens,
                    args.txt_tokens,
                    size,
                    compile_both=args.compile,
                    vs_compile=args.vs_compile,
                    graph=args.graph,
                    floor=args.floor,
                    options=options,
                    reference_tokens=args.reference_tokens,
                    block=args.block,
                    lead_in=args.lead_in,
                )
                results.append(result)
                torch.cuda.empty_cache()
        del subject
        gc.collect()  # drop the previous model (dev is 64 GB) before building the next
        torch.cuda.empty_cache()
    print(format_step_table(results, torch.cuda.get_device_name(), torch.__version__))
    if args.json:
        write_json([asdict(r) for r in results], args.json)
    if args.plot:
        from . import plot

        plot.save_step_plot(results, args.plot)
    exact = all(r.bit_exact and r.graph_bit_exact is not False for r in results)
    return 0 if args.compile or exact else 1
