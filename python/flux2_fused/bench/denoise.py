"""The `flux2-fused bench` run: a FLUX.2 flow-matching denoise loop, eager vs fused, and its report.

One model is built (random weights from `--seed`, or a diffusers folder) and one set of inputs is
drawn; the same loop then runs twice on them, once with `model.fused = False` (pure eager PyTorch)
and once with `model.fused = True`, so any difference in time or bits is the fused path's alone.

The loop, as FLUX.2 pipelines run it: latents x ~ N(0, 1) of shape [B, N_img, in_channels], random
text embeddings [B, text_tokens, joint_attention_dim], image ids (0, row, col, 0) and text ids
(0, 0, 0, i). Sigmas fall linearly from 1 to 0, sigma_i = 1 - i / steps for i = 0..steps (a plain
linear schedule rather than the pipelines' shifted one: the work a step does does not depend on
sigma, and a linear schedule needs no resolution-dependent shift). Each step is
`v = model(x, text, t=sigma_i, img_ids, txt_ids, guidance=4.0 if the config embeds guidance)` and
the Euler update `x = x + (sigma_{i+1} - sigma_i) * v`, computed in fp32 and rounded to the model
dtype, as diffusers' FlowMatchEulerDiscreteScheduler does.

Timing: one untimed warm-up step per mode first (where the fast path is on, the fused mode's first
call builds or loads the CUDA kernels and self-checks them against eager; where it is off, on the
CPU among others, the fused mode runs the same eager PyTorch as the eager mode). The two loops then
advance in alternation, step i of one mode next to step i of the other (the order swapping every
step), so clock and thermal drift hit both alike; each step is timed with CUDA events (perf_counter
on the CPU). One extra step per mode runs under torch.profiler to count launches and split kernel
time by site (`classify.kernel_class`, the step benchmark's table): `fused` (this package's
kernels, `ops.FUSED_KERNELS`), `norm` (LayerNorm / RMSNorm kernels), `elementwise` (aten's
elementwise kernels, among them the gated adds and modulations the fused kernels replace) and
`other` (GEMMs, attention, copies, ...). On the CPU the same split is made over
aten ops (self CPU time by op name) and the launch count is the number of aten ops, nested ones
included; where the fast path is off the fused mode still counts a few more, as its single blocks
write their two halves into one buffer where eager calls `cat` (`reading_notes` says so under the
summary, with the spread of the timed steps). Verdict: the final latents of the two loops are
bit-exact when `torch.equal` holds and their bytes have the same SHA-256.

The report's figures (and JSON fields) are documented on `results.bench.BenchReport`; the command that
plans, runs, prints and writes them is `flux2_fused.commands.bench_command`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TextIO, TypeVar

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from .. import __version__
from ..errors import BadValue
from ..models.flux2 import Flux2Config, Flux2Transformer, image_ids, text_ids
from ..models.flux2.model import folder_config
from ..ops import fast_path_reason, module_sources, self_check_records
from .classify import tally
from .options import (
    CPU_SIDE,
    DEFAULT_STEPS,
    DEFAULT_TEXT_TOKENS,
    GPU_SIDE,
    PX_PER_TOKEN,
    check_side,
    require_at_least_one,
)
from .results.bench import BenchReport, ModeResult
from .results.tables import MODES, SITES
from .step import tensor_sha256
from .timing import event_ms

T = TypeVar("T")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PRESETS = tuple(Flux2Config.PRESETS)
GUIDANCE = 4.0
# Activation memory of a dev forward (D = 6144, bf16), about 10 GB at 1024x1024 (4608 joint tokens);
# other shapes scale it by tokens, D and element size.
ACTIVATION_BYTES_PER_TOKEN = 10e9 / 4608
_DEV_DIM, _DEV_ITEMSIZE = 6144, 2
SLOW_CPU_RUN_S = 60  # a CPU run estimated to take longer gets a warning before it starts
MAX_CPU_RUN_S = 3600  # one estimated to take longer is refused unless --allow-slow


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class BenchRequest:
    """The bench options as given on the command line; None means "the default for this machine"."""

    config: str | None = None
    weights: Path | None = None
    height: int | None = None
    width: int | None = None
    steps: int = DEFAULT_STEPS
    batch: int = 1
    text_tokens: int = DEFAULT_TEXT_TOKENS
    seed: int = 0
    dtype: str | None = None


@dataclass(frozen=True)
class Plan:
    """A validated request with every default filled in for this machine."""

    device: torch.device
    config: Flux2Config
    weights: Path | None
    height: int
    width: int
    steps: int
    batch: int
    text_tokens: int
    seed: int
    dtype: torch.dtype
    fast_path_off: str | None  # why the fast path cannot run here (a note), None when it can
    notes: tuple[str, ...]

    @property
    def image_tokens(self) -> int:
        return (self.height // PX_PER_TOKEN) * (self.width // PX_PER_TOKEN)


def param_count(config: Flux2Config) -> int:
    """Parameters of a model with this config, counted on the meta device (no memory, milliseconds)."""
    with torch.device("meta"):
        return sum(p.numel() for p in Flux2Transformer(config).parameters())


def bytes_needed(config: Flux2Config, dtype: torch.dtype, tokens: int) -> float:
    """Weights plus activations of one forward over `tokens` joint tokens (batch included)."""
    scale = config.inner_dim / _DEV_DIM * dtype.itemsize / _DEV_ITEMSIZE
    return param_count(config) * dtype.itemsize + ACTIVATION_BYTES_PER_TOKEN * tokens * scale


def forward_flops(config: Flux2Config, batch: int, seq: int) -> float:
    """Rough FLOPs of one forward over `seq` joint tokens a sample: two a weight a token (the linear
    layers hold nearly all the weights) plus attention's two [seq, seq] products in every block."""
    blocks = config.num_layers + config.num_single_layers
    return 2 * param_count(config) * batch * seq + 4 * batch * seq**2 * config.inner_dim * blocks


def available_ram_bytes() -> int | None:
    """Memory the OS can give this process now (MemAvailable, which counts reclaimable caches; else
    the free pages), None where neither is known."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


def cpu_flops_per_s(dtype: torch.dtype) -> float:
    """This CPU's matmul rate in `dtype`, best of three 512-cube products (milliseconds): a model's
    forward is mostly matmuls, and the rate differs by far between machines and dtypes."""
    a = torch.randn(512, 512).to(dtype)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return 2 * 512**3 / best


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def cpu_seconds(
    config: Flux2Config, dtype: torch.dtype, batch: int, seq: int, steps: int
) -> tuple[float, str]:
    """The estimated time of a bench run on this CPU, in s, and how it was estimated (for the notes)."""
    forwards = len(MODES) * (steps + 2)  # each mode: the warm-up, the timed steps, the profiled step
    flops, rate = forward_flops(config, batch, seq), cpu_flops_per_s(dtype)
    how = f"{forwards} forwards of {flops / 1e12:.2f} TFLOP at a measured {rate / 1e9:.0f} GFLOP/s"
    return forwards * flops / rate, how


def check_cpu_run(p: Plan, allow_slow: bool = False) -> Plan:
    """On the CPU, refuse (BadValue) a run that cannot fit in memory (before the allocator fails
    half-way), or that would take over MAX_CPU_RUN_S unless `allow_slow` (a run of hours is more often
    a forgotten --config than a wish); the plan with the time estimate among its notes when the run
    will be slow. A plan for a GPU is returned as it is."""
    if p.device.type != "cpu":
        return p
    what = f"--weights {p.weights}" if p.weights is not None else f"--config {preset_name(p.config)}"
    what += f" in {dtype_name(p.dtype)}"
    seq = p.image_tokens + p.text_tokens  # joint tokens a sample
    need, have = bytes_needed(p.config, p.dtype, p.batch * seq), available_ram_bytes()
    if have is not None and need > have:
        raise BadValue(
            f"{what} needs about {need / 1e9:.1f} GB of memory (an estimate) and this machine has "
            f"{have / 1e9:.1f} GB available: choose a smaller --config (tiny) or a CUDA GPU"
        )
    seconds, how = cpu_seconds(p.config, p.dtype, p.batch, seq, p.steps)
    if seconds > MAX_CPU_RUN_S and not allow_slow:
        raise BadValue(
            f"{what} would take roughly {_duration(seconds)} on this CPU (an estimate: {how}); "
            "--config tiny takes seconds, --allow-slow starts it anyway"
        )
    if seconds < SLOW_CPU_RUN_S:
        return p
    note = (
        f"estimate: this run takes roughly {_duration(seconds)} on this CPU ({how}); "
        "--config tiny takes seconds"
    )
    return replace(p, notes=(*p.notes, note))


def default_config(free_bytes: int | None, tokens: int) -> str:
    """dev when its bf16 weights and activations fit in the GPU's free memory, klein-4b on a smaller
    GPU, tiny without one (`free_bytes` None)."""
    if free_bytes is None:
        return "tiny"
    fits = free_bytes >= bytes_needed(Flux2Config.preset("dev"), torch.bfloat16, tokens)
    return "dev" if fits else "klein-4b"


def plan(request: BenchRequest) -> Plan:
    """Validate the request (a --weights folder included) and fill in this machine's defaults; raises
    BadValue naming the option. The machine is asked for defaults only: what it cannot run is
    `check_cpu_run`'s to refuse, after every argument has been checked."""
    require_at_least_one(
        {"--steps": request.steps, "--batch": request.batch, "--text-tokens": request.text_tokens}
    )
    for option, value, known in (("--config", request.config, PRESETS), ("--dtype", request.dtype, DTYPES)):
        if value is not None and value not in known:
            raise BadValue(f"unknown {option} {value!r}; choose one of {', '.join(known)}")
    cuda = torch.cuda.is_available()
    side = GPU_SIDE if cuda else CPU_SIDE
    height = side if request.height is None else request.height
    width = side if request.width is None else request.width
    check_side("--height", height)
    check_side("--width", width)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = DTYPES[request.dtype or ("bf16" if cuda else "fp32")]
    notes: list[str] = []
    if request.weights is not None:
        config = folder_config(request.weights)
    elif request.config is not None:
        config = Flux2Config.preset(request.config)
    else:
        tokens = request.batch * (height * width // PX_PER_TOKEN**2 + request.text_tokens)
        free = torch.cuda.mem_get_info(device)[0] if cuda else None
        config = Flux2Config.preset(default_config(free, tokens))
        if free is not None and config != Flux2Config.preset("dev"):
            need = bytes_needed(Flux2Config.preset("dev"), torch.bfloat16, tokens)
            notes.append(
                f"{free / 1e9:.0f} GB free on the GPU and dev needs about {need / 1e9:.0f} GB: "
                f"benchmarking {preset_name(config)} (choose with --config)"
            )
    fast_path_off = fast_path_reason(device, dtype)
    if fast_path_off is not None:
        fast_path_off = f"the fast path is off here ({fast_path_off}): both modes run eager PyTorch"
        notes.append(fast_path_off)
    else:  # some op has a module; one that has none runs its eager chain in the fused mode
        notes += [
            f"{op} runs eager in the fused mode: no module for it here ({why})"
            for op, (source, why) in module_sources(device).items()
            if source is None
        ]
    return Plan(
        device=device,
        config=config,
        weights=request.weights,
        height=height,
        width=width,
        steps=request.steps,
        batch=request.batch,
        text_tokens=request.text_tokens,
        seed=request.seed,
        dtype=dtype,
        fast_path_off=fast_path_off,
        notes=tuple(notes),
    )


# --------------------------------------------------------------------------- the denoise loop


@dataclass(frozen=True)
class Inputs:
    """Everything a step feeds the model besides the latents and the timestep."""

    text: torch.Tensor
    img_ids: torch.Tensor
    txt_ids: torch.Tensor
    guidance: torch.Tensor | None


def make_inputs(config: Flux2Config, p: Plan) -> tuple[torch.Tensor, Inputs]:
    """(initial latents, the rest), drawn on the CPU from the seed so every device gets the same values."""
    gen = torch.Generator().manual_seed(p.seed)
    noise = torch.randn(p.batch, p.image_tokens, config.in_channels, generator=gen)
    text = torch.randn(p.batch, p.text_tokens, config.joint_attention_dim, generator=gen)
    img_ids = image_ids(p.image_tokens, width=p.width // PX_PER_TOKEN, device=p.device)
    guidance = torch.full((p.batch,), GUIDANCE, device=p.device) if config.guidance_embeds else None
    inputs = Inputs(text.to(p.device, p.dtype), img_ids, text_ids(p.text_tokens, device=p.device), guidance)
    return noise.to(p.device, p.dtype), inputs


def sigmas(steps: int) -> list[float]:
    """The linear flow-matching schedule 1 -> 0: steps + 1 values."""
    return [1 - i / steps for i in range(steps + 1)]


def euler_step(
    model: Flux2Transformer, x: torch.Tensor, inputs: Inputs, sigma: float, sigma_next: float
) -> torch.Tensor:
    """One flow-matching Euler step; the update in fp32, rounded to x's dtype (diffusers' scheduler)."""
    t = torch.full((x.shape[0],), sigma, device=x.device)
    v = model(x, inputs.text, t, inputs.img_ids, inputs.txt_ids, inputs.guidance)
    return (x.float() + (sigma_next - sigma) * v.float()).to(x.dtype)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """(fn(), its time in ms): CUDA events on a GPU, so the host's lead over the GPU is not counted."""
    if device.type != "cuda":
        start = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - start) * 1e3
    return event_ms(fn)


# --------------------------------------------------------------------------- profiling


@dataclass
class ProfiledStep:
    launches: int
    site_ms: dict[str, float]
    site_launches: dict[str, int]


@contextlib.contextmanager
def _quiet_stderr_fd() -> Iterator[None]:
    """Silence file descriptor 2: kineto prints "profiler_start/stop" lines there from C++."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def profile_step(fn: Callable[[], object], device: torch.device) -> ProfiledStep:
    """Launches and per-site time of one call of `fn`, from torch.profiler."""
    # Kernels only on a GPU: recording the host's aten ops too would only slow the post-processing.
    prof = profile(activities=[ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU])
    with _quiet_stderr_fd():
        prof.start()
    try:
        fn()
        _synchronize(device)
    finally:
        with _quiet_stderr_fd():
            prof.stop()
    events = prof.events()
    if device.type == "cuda":
        timed = [(e.name, e.time_range.elapsed_us()) for e in events if e.device_type == DeviceType.CUDA]
    else:
        ops = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
        timed = [(e.name, e.self_cpu_time_total) for e in ops]
    site_ms, site_launches = tally(timed, SITES)
    return ProfiledStep(len(timed), site_ms, site_launches)


# --------------------------------------------------------------------------- the run and its report


def dtype_name(dtype: torch.dtype) -> str:
    """bf16, fp16 or fp32: the names the options use."""
    return next(name for name, value in DTYPES.items() if value == dtype)


def preset_name(config: Flux2Config) -> str:
    """The preset this config equals, else "custom" (a weights folder of another shape)."""
    return next((name for name in PRESETS if Flux2Config.preset(name) == config), "custom")


def build_model(p: Plan) -> Flux2Transformer:
    """Random weights for a preset, or the weights folder (WeightsError when it cannot be loaded)."""
    if p.weights is not None:
        model = Flux2Transformer.from_pretrained(p.weights, device=p.device, dtype=p.dtype)
    else:
        model = Flux2Transformer.random(p.config, seed=p.seed, device=p.device, dtype=p.dtype)
    return model.eval().requires_grad_(False)


def _self_check_dicts() -> list[dict]:
    return [
        {"op": op, "device": device, "config": config, **asdict(record)}
        for (op, device, config, _torch), record in self_check_records().items()
    ]


def _fused_status(p: Plan, fused: ModeResult, checks: list[dict]) -> tuple[bool, str]:
    """(active, why): active only when the fused kernel was seen running and its self-check passed."""
    if p.fast_path_off is not None:
        return False, p.fast_path_off
    failed = next((c for c in checks if not c["passed"]), None)
    if failed is not None:
        return False, f"self-check failed for {failed['op']} {failed['config']}: {failed['detail']}"
    launches = fused.site_launches["fused"]
    if launches == 0:
        return False, "no fused kernel ran (the guards declined every site)"
    passed = ", ".join(f"{c['op']} {c['config']} in {c['seconds']:.2f} s" for c in checks)
    return True, f"{launches} fused launches a step; self-check passed ({passed})"


def _warmup_note(p: Plan) -> str:
    """What the fused mode's warm-up step does besides the step, said before it starts (it can take
    seconds)."""
    if p.fast_path_off is not None:
        return " (the fast path is off here: the same eager PyTorch as the eager mode)"
    return " (the first fused call builds or loads the kernels and self-checks them against eager)"


def measure(model: Flux2Transformer, p: Plan, log: TextIO) -> tuple[dict[str, ModeResult], bool]:
    """Warm-up, the interleaved timed loops and one profiled step, for each mode; and whether the
    final latents of the two modes are torch.equal."""
    noise, inputs = make_inputs(p.config, p)
    schedule = sigmas(p.steps)

    def step(mode: str, x: torch.Tensor, i: int) -> torch.Tensor:
        # Where the fast path is off (the CPU, fp32, a GPU older than sm_80, ...) the fused mode still
        # runs with `fused = True`, through the fused code path whose ops decline to eager.
        model.fused = mode == "fused"
        return euler_step(model, x, inputs, schedule[i], schedule[i + 1])

    warmup_s: dict[str, float] = {}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    latents = dict.fromkeys(MODES, noise)
    with torch.inference_mode():
        for mode in MODES:
            print(f"flux2-fused: warm-up step, {mode}{_warmup_note(p) if mode == 'fused' else ''}", file=log)
            start = time.perf_counter()
            step(mode, noise, 0)
            _synchronize(p.device)
            warmup_s[mode] = time.perf_counter() - start
        bar = tqdm(range(p.steps), desc="denoise (eager | fused)", unit="step", file=log)
        for i in bar:
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                latents[mode], ms = timed_ms(functools.partial(step, mode, latents[mode], i), p.device)
                times[mode].append(ms)
            bar.set_postfix_str(f"{times['eager'][-1]:.1f} | {times['fused'][-1]:.1f} ms")
        bar.close()
        profiled = {mode: profile_step(functools.partial(step, mode, noise, 0), p.device) for mode in MODES}
    results = {
        mode: ModeResult(
            step_ms=times[mode],
            median_ms=statistics.median(times[mode]),
            warmup_s=warmup_s[mode],
            launches_per_step=profiled[mode].launches,
            site_ms=profiled[mode].site_ms,
            site_launches=profiled[mode].site_launches,
            sha256=tensor_sha256(latents[mode]),
        )
        for mode in MODES
    }
    return results, torch.equal(latents["eager"], latents["fused"])


def run(p: Plan, log: TextIO | None = None) -> BenchReport:
    """Build the model, measure both modes, and report. Progress goes to `log` (stderr)."""
    log = log or sys.stderr
    started = time.perf_counter()
    what = str(p.weights) if p.weights is not None else f"random {preset_name(p.config)} weights"
    print(f"flux2-fused: building the model ({what}, {dtype_name(p.dtype)})", file=log)
    model = build_model(p)
    _synchronize(p.device)
    build_s = time.perf_counter() - started
    results, equal = measure(model, p, log)
    checks = _self_check_dicts()
    fused_active, fused_status = _fused_status(p, results["fused"], checks)
    config, cuda = p.config, p.device.type == "cuda"
    return BenchReport(
        flux2_fused=__version__,
        torch=torch.__version__,
        device=str(p.device),
        gpu=torch.cuda.get_device_name(p.device) if cuda else None,
        compute_capability=".".join(map(str, torch.cuda.get_device_capability(p.device))) if cuda else None,
        config=preset_name(config),
        weights=str(p.weights) if p.weights is not None else None,
        inner_dim=config.inner_dim,
        double_blocks=config.num_layers,
        single_blocks=config.num_single_layers,
        params=sum(param.numel() for param in model.parameters()),
        dtype=dtype_name(p.dtype),
        height=p.height,
        width=p.width,
        batch=p.batch,
        image_tokens=p.image_tokens,
        text_tokens=p.text_tokens,
        steps=p.steps,
        seed=p.seed,
        guidance=GUIDANCE if config.guidance_embeds else None,
        schedule=f"linear sigmas 1 -> 0 over {p.steps} steps; Euler x += (sigma_next - sigma) * v in fp32",
        launch_unit="cuda kernels" if cuda else "aten ops",
        eager=results["eager"],
        fused=results["fused"],
        # Without the fast path both modes ran the same eager code: their difference is noise.
        speedup_pct=100 * (results["eager"].median_ms / results["fused"].median_ms - 1)
        if fused_active
        else None,
        bit_exact=equal and results["eager"].sha256 == results["fused"].sha256,
        fused_active=fused_active,
        fused_status=fused_status,
        self_checks=checks,
        notes=list(p.notes),
        build_s=build_s,
        total_s=time.perf_counter() - started,
    )


def reading_notes(r: BenchReport) -> list[str]:
    """How to read a run's figures where they would mislead, printed under the summary: without the
    fast path both modes ran the same eager code, so their gap is noise (its spread given, with what
    steadies it on a CPU); on the CPU the per-site columns are one profiled step's op self time, with
    the profiler's overhead, not a split of the median; and the op counts of the two modes differ by
    the fused code path's single-block buffer, not by any arithmetic."""
    notes = []
    cpu = r.gpu is None
    if not r.fused_active:
        spread = " and ".join(
            f"{min(m.step_ms):.1f}-{max(m.step_ms):.1f} ms ({mode})"
            for mode, m in (("eager", r.eager), ("fused", r.fused))
        )
        note = (
            f"both modes ran the same eager code, so the gap between their medians is noise: the "
            f"{r.steps} timed steps a mode took {spread}"
        )
        if cpu:
            note += (
                f", on {torch.get_num_threads()} CPU threads; on a small or shared CPU, OMP_NUM_THREADS=1 "
                "(torch.set_num_threads(1) in Python) often steadies them, and more --steps steady the "
                "medians"
            )
        notes.append(note)
    if cpu:
        sums = " and ".join(
            f"{sum(m.site_ms.values()):.2f} ms {mode}" for mode, m in (("eager", r.eager), ("fused", r.fused))
        )
        notes.append(
            f"the {', '.join(SITES)} ms columns split one more step, run under the profiler (aten op self "
            f"time, {sums} in all, the profiler's overhead included), not the median step"
        )
    if not r.fused_active and r.eager.launches_per_step != r.fused.launches_per_step:
        notes.append(
            f"{r.launch_unit}/step differ ({r.eager.launches_per_step} eager, {r.fused.launches_per_step} "
            "fused) though both ran eager: the fused mode's code writes each single block's attention and "
            "MLP outputs into the halves of one buffer (empty, copy_) where eager concatenates them (cat); "
            "the arithmetic is the same"
        )
    return notes
