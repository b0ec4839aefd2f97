"""The `flux2-fused bench` run: a FLUX.2 flow-matching denoise loop, eager vs fused, and its report.

One model is built (random weights from `--seed`, or a diffusers folder) and one set of inputs is
drawn; the same loop then runs twice on them, once with `model.fused = False` (pure eager PyTorch)
and once with `model.fused = True`, so any difference in time or bits is the fused path's alone.

The loop (FLUX2.md, "Pipeline facts"): latents x ~ N(0, 1) of shape [B, N_img, in_channels], random
text embeddings [B, text_tokens, joint_attention_dim], image ids (0, row, col, 0) and text ids
(0, 0, 0, i). Sigmas fall linearly from 1 to 0, sigma_i = 1 - i / steps for i = 0..steps (a plain
linear schedule rather than the pipelines' shifted one: the work a step does does not depend on
sigma, and a linear schedule needs no resolution-dependent shift). Each step is
`v = model(x, text, t=sigma_i, img_ids, txt_ids, guidance=4.0 if the config embeds guidance)` and
the Euler update `x = x + (sigma_{i+1} - sigma_i) * v`, computed in fp32 and rounded to the model
dtype, as diffusers' FlowMatchEulerDiscreteScheduler does.

Timing: one untimed warm-up step per mode first (the fused mode's first call builds or loads the
CUDA kernel and self-checks it against eager). The two loops then advance in alternation, step i of
one mode next to step i of the other (the order swapping every step), so clock and thermal drift hit
both alike; each step is timed with CUDA events (perf_counter on the CPU). One extra step per mode
runs under torch.profiler to count launches and split kernel time by site: `fused` (our
gated_resnorm_kernel), `norm` (LayerNorm / RMSNorm kernels), `elementwise` (aten's elementwise
kernels, among them the gated adds and modulations the fused kernel replaces) and `other` (GEMMs,
attention, copies, ...). On the CPU the same split is made over aten ops (self CPU time by op name)
and the launch count is the number of aten ops, nested ones included. Verdict: the final latents of
the two loops are bit-exact when `torch.equal` holds and their bytes have the same SHA-256.

JSON fields (`--json FILE`; times in ms unless the name says s):
- flux2_fused: package version
- torch: torch version
- device: the torch device the run used ("cuda:0", "cpu")
- gpu: GPU name, null on the CPU
- compute_capability: "major.minor", null on the CPU
- config: preset name (dev, klein-4b, klein-9b, tiny), or "custom" for weights matching none
- weights: the weights folder, null for random weights
- inner_dim: D, the width of the residual streams
- double_blocks: number of double-stream blocks
- single_blocks: number of single-stream blocks
- params: parameter count
- dtype: bf16, fp16 or fp32
- height: image height in pixels
- width: image width in pixels
- batch: batch size
- image_tokens: image tokens a sample, (height / 16) * (width / 16)
- text_tokens: text tokens a sample
- steps: timed denoise steps a mode
- seed: seed of the weights, latents and text embeddings
- guidance: the guidance value given to the model, null when the config has no guidance embedder
- schedule: the sigma schedule and update rule, in words
- launch_unit: what launches_per_step counts ("cuda kernels" or "aten ops")
- eager: the eager mode's results (fields below)
- fused: the fused mode's results (fields below)
- speedup_pct: 100 * (eager median / fused median - 1); positive when fused is faster
- bit_exact: the final latents of both modes are identical (torch.equal and equal SHA-256)
- fused_active: the fused kernel really ran in the fused mode (self-check passed, launches seen)
- fused_status: why the fused path was or was not active, in words
- self_checks: the kernel self-check verdicts of this process: op, device, config, passed, detail, seconds
- notes: the notes printed before the run (machine-dependent choices, fallbacks)
- build_s: seconds to build or load the model
- total_s: seconds for the whole run

Per mode (`eager`, `fused`):
  - step_ms: time of each timed step, in order
  - median_ms: median of step_ms
  - warmup_s: the untimed warm-up step (fused: includes the kernel build or load and self-check)
  - launches_per_step: CUDA kernels (on the CPU: aten ops, nested ones included) in the profiled step
  - site_ms: kernel time (CPU: op self time) of the profiled step by site: fused, norm, elementwise, other
  - site_launches: launches of the profiled step by the same sites
  - sha256: SHA-256 of the final latents' bytes

The other commands' logic lives here too, so that `flux2_fused.cli` only parses: `verify_command`
(the kernel's live self-check for every hidden size the models use, and one that is not a multiple
of the kernel's 512-element pass) and `build_command` (compile without a GPU, one library a target).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO, TypeVar

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from .. import __version__
from ..models.flux2 import Flux2Config, Flux2Transformer, image_ids, text_ids
from ..models.weights import CONFIG_NAME, WeightsError, read_config, shard_files
from ..ops import DISABLE_ENV, OPS, jit, kill_switch, self_check_records
from ..ops.gated_resnorm import SUPPORTED_DTYPES
from .step import FUSED_KERNEL, tensor_sha256
from .timing import event_ms

T = TypeVar("T")

MODES = ("eager", "fused")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PRESETS = tuple(Flux2Config.PRESETS)
PX_PER_TOKEN = 16  # the VAE downsamples 8x and FLUX.2 packs 2x2 latent pixels into a token
GUIDANCE = 4.0
GPU_SIDE, CPU_SIDE = 1024, 256  # default image side in pixels
DEFAULT_STEPS = 4
DEFAULT_TEXT_TOKENS = 512
MIN_FUSED_CAPABILITY = (8, 0)
# Activation memory of a dev forward, about 10 GB at 1024x1024 (4608 joint tokens), scaled per token.
ACTIVATION_BYTES_PER_TOKEN = 10e9 / 4608
SITES = ("fused", "norm", "elementwise", "other")
# Kernel names on the GPU, aten op names on the CPU; the first pattern that matches names the site.
_SITE_PATTERNS = (
    ("fused", re.compile(re.escape(FUSED_KERNEL))),
    ("norm", re.compile(r"layer_?norm|rms_?norm", re.IGNORECASE)),
    (
        "elementwise",
        re.compile(r"elementwise_kernel|^aten::(?:add|mul|sub|div|neg|silu|clamp|clip|cos|sin|exp|pow)_?$"),
    ),
)


class BenchError(Exception):
    """A problem the user can fix, reported as one line; `exit_code` is the process's exit status."""

    exit_code = 1


class BadValue(BenchError):
    """An option value the run cannot use (a usage error, hence argparse's exit status)."""

    exit_code = 2


class NeedsCuda(BenchError):
    """The command needs a CUDA GPU and this machine has none."""

    exit_code = 2


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
    fused_unavailable: str | None  # why the fused path cannot run here, None when it can
    fused_allowed: bool  # `model.fused` in the fused mode
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
    return param_count(config) * dtype.itemsize + ACTIVATION_BYTES_PER_TOKEN * tokens


def default_config(free_bytes: int | None, tokens: int) -> str:
    """dev when its bf16 weights and activations fit in the GPU's free memory, klein-4b on a smaller
    GPU, tiny without one (`free_bytes` None)."""
    if free_bytes is None:
        return "tiny"
    fits = free_bytes >= bytes_needed(Flux2Config.preset("dev"), torch.bfloat16, tokens)
    return "dev" if fits else "klein-4b"


def _check_side(name: str, value: int) -> None:
    if value < PX_PER_TOKEN or value % PX_PER_TOKEN:
        raise BadValue(
            f"--{name} {value} is not a positive multiple of {PX_PER_TOKEN} "
            f"(FLUX.2 has one latent token per {PX_PER_TOKEN}x{PX_PER_TOKEN} pixels)"
        )


def _check_output(option: str, path: Path | None) -> None:
    """Fail before the run, not after minutes of it, when an output file cannot be written."""
    if path is not None and not path.parent.is_dir():
        raise BadValue(f"{option} {path}: folder {path.parent} does not exist")


def fused_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the fused path cannot run on this device in this dtype (one line), None when it can."""
    if device.type != "cuda":
        return "no CUDA GPU: the fused path needs one, so both modes run eager PyTorch on the CPU"
    if torch.cuda.get_device_capability(device) < MIN_FUSED_CAPABILITY:
        have = ".".join(map(str, torch.cuda.get_device_capability(device)))
        need = ".".join(map(str, MIN_FUSED_CAPABILITY))
        return (
            f"{torch.cuda.get_device_name(device)} has compute capability {have} and the fused kernel "
            f"needs {need} or newer: both modes run eager"
        )
    if dtype not in SUPPORTED_DTYPES:
        return "the fused kernel takes bf16 and fp16 only: with fp32 both modes run eager"
    if kill_switch():
        return f"{DISABLE_ENV} is set: both modes run eager"
    return None


def weights_config(folder: Path) -> Flux2Config:
    """The architecture a weights folder declares, read before anything heavy so a bad folder fails
    first (WeightsError naming the file)."""
    try:
        config = Flux2Config.from_diffusers(read_config(folder))
    except WeightsError:
        raise
    except (TypeError, ValueError) as err:
        raise WeightsError(f"{folder / CONFIG_NAME}: {err}") from err
    shard_files(folder)  # only checks that the weights files are there
    return config


def plan(request: BenchRequest, json_path: Path | None = None, plot_path: Path | None = None) -> Plan:
    """Validate the request and fill in this machine's defaults; raises BadValue naming the option."""
    for name, value in (
        ("steps", request.steps),
        ("batch", request.batch),
        ("text-tokens", request.text_tokens),
    ):
        if value < 1:
            raise BadValue(f"--{name} must be at least 1, got {value}")
    for option, value, known in (("--config", request.config, PRESETS), ("--dtype", request.dtype, DTYPES)):
        if value is not None and value not in known:
            raise BadValue(f"unknown {option} {value!r}; choose one of {', '.join(known)}")
    _check_output("--json", json_path)
    _check_output("--plot", plot_path)
    cuda = torch.cuda.is_available()
    side = GPU_SIDE if cuda else CPU_SIDE
    height = side if request.height is None else request.height
    width = side if request.width is None else request.width
    _check_side("height", height)
    _check_side("width", width)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = DTYPES[request.dtype or ("bf16" if cuda else "fp32")]
    notes: list[str] = []
    if request.weights is not None:
        config = weights_config(request.weights)
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
    unavailable = fused_unavailable(device, dtype)
    if unavailable is not None:
        notes.append(unavailable)
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
        fused_unavailable=unavailable,
        # Too old a GPU: never try to build the kernel for it. Elsewhere (the CPU, fp32) the fused mode
        # still runs with `fused = True`, through the fused code path whose guards decline to eager.
        fused_allowed=not cuda or torch.cuda.get_device_capability(device) >= MIN_FUSED_CAPABILITY,
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


def site_of(name: str) -> str:
    """The site a CUDA kernel or aten op belongs to, by its name."""
    return next((site for site, pattern in _SITE_PATTERNS if pattern.search(name)), "other")


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
    site_ms, site_launches = dict.fromkeys(SITES, 0.0), dict.fromkeys(SITES, 0)
    for name, us in timed:
        site = site_of(name)
        site_ms[site] += us / 1e3
        site_launches[site] += 1
    return ProfiledStep(len(timed), site_ms, site_launches)


# --------------------------------------------------------------------------- the run and its report


@dataclass
class ModeResult:
    step_ms: list[float]
    median_ms: float
    warmup_s: float
    launches_per_step: int
    site_ms: dict[str, float]
    site_launches: dict[str, int]
    sha256: str


@dataclass
class BenchReport:
    """Every figure of the summary; the JSON fields, documented in the module docstring."""

    flux2_fused: str
    torch: str
    device: str
    gpu: str | None
    compute_capability: str | None
    config: str
    weights: str | None
    inner_dim: int
    double_blocks: int
    single_blocks: int
    params: int
    dtype: str
    height: int
    width: int
    batch: int
    image_tokens: int
    text_tokens: int
    steps: int
    seed: int
    guidance: float | None
    schedule: str
    launch_unit: str
    eager: ModeResult
    fused: ModeResult
    speedup_pct: float
    bit_exact: bool
    fused_active: bool
    fused_status: str
    self_checks: list[dict]
    notes: list[str]
    build_s: float
    total_s: float


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
    if p.fused_unavailable is not None:
        return False, p.fused_unavailable
    failed = next((c for c in checks if not c["passed"]), None)
    if failed is not None:
        return False, f"self-check failed for {failed['op']} {failed['config']}: {failed['detail']}"
    launches = fused.site_launches["fused"]
    if launches == 0:
        return False, "no fused kernel ran (the guards declined every site)"
    passed = ", ".join(f"{c['op']} {c['config']} in {c['seconds']:.2f} s" for c in checks)
    return True, f"{launches} fused launches a step; self-check passed ({passed})"


def measure(model: Flux2Transformer, p: Plan, log: TextIO) -> tuple[dict[str, ModeResult], bool]:
    """Warm-up, the interleaved timed loops and one profiled step, for each mode; and whether the
    final latents of the two modes are torch.equal."""
    noise, inputs = make_inputs(p.config, p)
    schedule = sigmas(p.steps)

    def step(mode: str, x: torch.Tensor, i: int) -> torch.Tensor:
        model.fused = mode == "fused" and p.fused_allowed
        return euler_step(model, x, inputs, schedule[i], schedule[i + 1])

    warmup_s: dict[str, float] = {}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    latents = dict.fromkeys(MODES, noise)
    with torch.inference_mode():
        for mode in MODES:
            first_use = " (the first fused call builds or loads the kernel and self-checks it)"
            print(f"flux2-fused: warm-up step, {mode}{first_use if mode == 'fused' else ''}", file=log)
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
        speedup_pct=100 * (results["eager"].median_ms / results["fused"].median_ms - 1),
        bit_exact=equal and results["eager"].sha256 == results["fused"].sha256,
        fused_active=fused_active,
        fused_status=fused_status,
        self_checks=checks,
        notes=list(p.notes),
        build_s=build_s,
        total_s=time.perf_counter() - started,
    )


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def format_summary(r: BenchReport) -> str:
    """The human-readable report: setup, the per-mode table, the fused-path status and the verdict."""
    source = r.weights or f"random weights, seed {r.seed}"
    device = f"{r.gpu} (sm {r.compute_capability})" if r.gpu else "CPU"
    guidance = f"guidance {r.guidance}" if r.guidance is not None else "no guidance embedder"
    rows = []
    for mode in MODES:
        m: ModeResult = getattr(r, mode)
        speedup = "-" if mode == "eager" else f"{r.speedup_pct:+.1f}%"
        sites = [f"{m.site_ms[site]:.2f}" for site in SITES]
        rows.append([mode, f"{m.median_ms:.2f}", speedup, m.launches_per_step, *sites, f"{m.warmup_s:.2f}"])
    headers = ["mode", "median ms/step", "speedup", f"{r.launch_unit}/step"]
    headers += [f"{site} ms" for site in SITES] + ["warm-up s"]
    verdict = "yes" if r.bit_exact else "NO"
    return "\n".join(
        [
            f"flux2-fused bench: {r.config} (D={r.inner_dim}, {r.double_blocks} double + {r.single_blocks} "
            f"single blocks, {_count(r.params)} params, {source}), {r.dtype}",
            f"{r.height}x{r.width} px = {r.image_tokens} image + {r.text_tokens} text tokens, "
            f"batch {r.batch}, {guidance}; {r.schedule}",
            f"device: {device}, torch {r.torch}, flux2-fused {r.flux2_fused}",
            f"fused path: {'active' if r.fused_active else 'NOT active'}: {r.fused_status}",
            "",
            markdown_table(headers, rows),
            f"(site ms: {'kernel time' if r.gpu else 'aten op self time'} of one profiled step)",
            "",
            f"bit-exact: {verdict} (final latents of both modes, torch.equal and SHA-256)",
            f"  sha256 eager {r.eager.sha256}",
            f"  sha256 fused {r.fused.sha256}",
        ]
    )


def write_json(report: BenchReport, path: Path) -> None:
    path.write_text(json.dumps(asdict(report), indent=2) + "\n", encoding="utf-8")


def bench_command(request: BenchRequest, json_path: Path | None = None, plot_path: Path | None = None) -> int:
    """`flux2-fused bench`: plan, run, print the summary, write the files; 1 when not bit-exact."""
    from . import plot  # it imports this module, and matplotlib only when drawing

    p = plan(request, json_path, plot_path)
    if plot_path is not None:
        plot.require_matplotlib()
    for note in p.notes:
        print(f"flux2-fused: {note}", file=sys.stderr)
    report = run(p)
    print(format_summary(report))
    for path, write in ((json_path, write_json), (plot_path, plot.save_plot)):
        if path is not None:
            write(report, path)
            print(f"flux2-fused: wrote {path}", file=sys.stderr)
    if not report.bit_exact:
        print(
            "flux2-fused: error: the fused and eager final latents differ (see the SHA-256s)", file=sys.stderr
        )
        return 1
    return 0


# --------------------------------------------------------------------------- verify and build


def require_cuda(what: str) -> torch.device:
    """The current CUDA device, or NeedsCuda naming the command that needs one."""
    if not torch.cuda.is_available():
        raise NeedsCuda(f"{what} needs a CUDA GPU and none is available")
    return torch.device("cuda", torch.cuda.current_device())


@dataclass
class VerifyRow:
    op: str
    config: str
    passed: bool
    detail: str
    seconds: float


def verify_kernel() -> list[VerifyRow]:
    """Every op's live bit-exactness self-check on this GPU, for each of its verify configurations."""
    device = require_cuda("verify")
    rows = []
    for op in OPS:
        jit.module_for(op.spec, device)  # build once up front: a failed build is one error, not 12
        for config in op.verify_configs:
            start = time.perf_counter()
            try:
                with torch.inference_mode():
                    passed, detail = op.self_check(device, config)
            except Exception as exc:  # a crash is a failed check of this row; the others still run
                passed, detail = False, f"{type(exc).__name__}: {exc}"
            rows.append(VerifyRow(op.name, str(config), passed, detail, time.perf_counter() - start))
    return rows


def format_verify(rows: Sequence[VerifyRow]) -> str:
    device = torch.cuda.get_device_name()
    table = markdown_table(
        ["op", "configuration", "passed", "detail", "seconds"],
        [[r.op, r.config, "yes" if r.passed else "NO", r.detail, f"{r.seconds:.3f}"] for r in rows],
    )
    failed = sum(not r.passed for r in rows)
    verdict = "all bit-exact" if not failed else f"{failed} of {len(rows)} FAILED"
    return f"flux2-fused verify on {device}, torch {torch.__version__}\n{table}\n{verdict}"


def verify_command() -> int:
    """`flux2-fused verify`: print the self-check table; 1 when any configuration fails."""
    rows = verify_kernel()
    print(format_verify(rows))
    return 0 if all(r.passed for r in rows) else 1


def default_archs() -> list[str]:
    """The present GPU's architecture, else Hopper and Blackwell (9.0, 10.0)."""
    if torch.cuda.is_available():
        return [jit.device_arch(torch.cuda.current_device())]
    return ["9.0", "10.0"]


def build_command(archs: Sequence[str]) -> int:
    """`flux2-fused build`: compile (or find cached) one library per architecture and print its path.

    One library per architecture, not one fat binary, because that is what the runtime loads
    (`jit.load_module(arch)`): this fills exactly the cache entries a later run looks up.
    """
    for arch in archs:
        print(
            f"flux2-fused: building the kernels for sm {arch} (cached after the first build)", file=sys.stderr
        )
        for op in OPS:
            print(f"{arch} {op.name}: {jit.build(op.spec, [arch])}")
    return 0
