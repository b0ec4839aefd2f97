"""The GPU's clocks, power, temperature and clock-limit reasons while eager and fused steps run.

    python -m flux2_fused.bench.clocks [--configs klein-4b] [--host package|diffusers] [--blocks 6]
                                       [--modes eager fused [floor]] [--steps 30]
                                       [--quantize none|float8-row|float8-tensor|int8]
                                       [--interval-ms 20] [--json FILE]

Why: sustained fused steps take longer than the sum of their kernels measured alone, and an earlier
sampling saw the SM clock lower during fused steps than during eager ones at lower power. Whether
something of ours lowers the clock (the power or occupancy profile of the fused kernels next to the
GEMMs) or the machine does, shows in what the driver reports while each mode runs.

Each config's model (`step.Subject`) runs blocks of `--steps` pipelined 1024x1024 steps of one mode,
the modes taking turns (eager and fused; `--modes eager fused floor` adds the fused step's GEMMs and
attention alone, `bench.floor`: whether those kernels alone run at the fused step's clock), after a
warm-up and an unreported lead-in block of the last mode while the sampler runs (so every reported
block follows a block of another mode, none an idle GPU). Meanwhile `nvidia-smi` samples the GPU
every `--interval-ms`: SM and memory clock, power, temperature and the active clock-event reasons
(the driver's bitmask of why the clock is below its maximum: power cap, thermal slowdown, ...).
Each block reports its step time (CUDA events around the block, divided by its steps) and its
samples' median, minimum and maximum SM clock, median power, last temperature, and the share of
samples in which each reason was active.
"""

from __future__ import annotations

import datetime
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from .options import QUANTIZATIONS, STEP_CONFIGS, add_configs_argument, no_package_model, tool_parser
from .results.tables import markdown_table

# nvidia-smi's clock-event reason bits (nvmlClocksEventReasons).
REASONS = {
    0x1: "idle",
    0x2: "applications clocks setting",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
    0x100: "display clock setting",
}
FIELDS = "timestamp,clocks.sm,clocks.mem,{power},temperature.gpu,{reasons}"
# The instantaneous power (driver 535+; `power.draw` is a one-second average on recent GPUs, longer
# than a block's share of it), and the older field.
POWER_FIELDS = ("power.draw.instant", "power.draw")
# The reasons' field: its name since driver 535, and the older one.
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
TIMESTAMP = "%Y/%m/%d %H:%M:%S.%f"
# The blocks' modes: diffusers' or the package's eager step, the fused step, and the fused step's
# GEMM and attention calls alone (`bench.floor`), which shows the clock those kernels run at alone.
MODES = ("eager", "fused", "floor")
DEFAULT_MODES = ("eager", "fused")


@dataclass
class Sample:
    """One nvidia-smi reading: when (seconds since the epoch, local clock), SM and memory clock (MHz),
    power (W), temperature (C) and the active clock-event reasons' bitmask."""

    time: float
    sm_mhz: float
    mem_mhz: float
    power_w: float
    temperature_c: float
    reasons: int


def parse_samples(text: str) -> list[Sample]:
    """nvidia-smi's `--format=csv,noheader,nounits` lines of FIELDS; lines it could not read (a
    value "[N/A]", a partial last line) are skipped."""
    samples = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != 6:
            continue
        try:
            stamp = datetime.datetime.strptime(cells[0], TIMESTAMP).timestamp()
            samples.append(Sample(stamp, *map(float, cells[1:5]), int(cells[5], 16)))
        except ValueError:
            continue
    return samples


def reason_names(mask: int) -> list[str]:
    """The names of the reasons set in a clock-event bitmask (unknown bits by their value)."""
    names = [name for bit, name in REASONS.items() if mask & bit]
    unknown = mask & ~sum(REASONS)
    return names + ([f"0x{unknown:x}"] if unknown else [])


@dataclass
class Block:
    """One block of steps of one mode and what the GPU reported meanwhile.

    - mode: "eager", "fused" or "floor"
    - steps: steps in the block
    - step_ms: the block's GPU time (CUDA events around it) divided by its steps
    - samples: nvidia-smi readings taken during the block
    - sm_mhz_median: the SM clock's median over those readings (MHz)
    - sm_mhz_min: its minimum (MHz)
    - sm_mhz_max: its maximum (MHz)
    - mem_mhz_median: the memory clock's median (MHz)
    - power_w_median: the power draw's median (W)
    - temperature_c_last: the last reading's temperature (C)
    - reasons: share of readings (0-1) in which each clock-event reason was active
    """

    mode: str
    steps: int
    step_ms: float
    samples: int
    sm_mhz_median: float
    sm_mhz_min: float
    sm_mhz_max: float
    mem_mhz_median: float
    power_w_median: float
    temperature_c_last: float
    reasons: dict[str, float]


def summarize(mode: str, steps: int, step_ms: float, samples: Sequence[Sample]) -> Block:
    """A block's figures from the readings taken during it (NaN where there were none)."""
    nan = float("nan")

    def median(values: list[float]) -> float:
        return statistics.median(values) if values else nan

    sm = [s.sm_mhz for s in samples]
    counts: dict[str, int] = {}
    for sample in samples:
        for name in reason_names(sample.reasons):
            counts[name] = counts.get(name, 0) + 1
    return Block(
        mode=mode,
        steps=steps,
        step_ms=step_ms,
        samples=len(samples),
        sm_mhz_median=median(sm),
        sm_mhz_min=min(sm, default=nan),
        sm_mhz_max=max(sm, default=nan),
        mem_mhz_median=median([s.mem_mhz for s in samples]),
        power_w_median=median([s.power_w for s in samples]),
        temperature_c_last=samples[-1].temperature_c if samples else nan,
        reasons={name: n / len(samples) for name, n in sorted(counts.items())},
    )


def format_blocks(config: str, blocks: Sequence[Block]) -> str:
    """One row a block, in run order."""
    headers = ["config", "block", "mode", "ms a step", "SM MHz median (min-max)", "mem MHz", "W", "C"]
    rows = [
        [
            config,
            i,
            b.mode,
            f"{b.step_ms:.2f}",
            f"{b.sm_mhz_median:.0f} ({b.sm_mhz_min:.0f}-{b.sm_mhz_max:.0f})",
            f"{b.mem_mhz_median:.0f}",
            f"{b.power_w_median:.0f}",
            f"{b.temperature_c_last:.0f}",
            ", ".join(f"{name} {share:.0%}" for name, share in b.reasons.items()) or "-",
        ]
        for i, b in enumerate(blocks)
    ]
    return markdown_table([*headers, "clock-event reasons (share of samples)"], rows)


def _nvidia_smi(*args: str) -> bool:
    """Whether nvidia-smi accepts these arguments (one query, no loop)."""
    done = subprocess.run(["nvidia-smi", *args, "--format=csv"], capture_output=True, text=True, check=False)
    return done.returncode == 0


class Sampler:
    """nvidia-smi sampling GPU `gpu` (its UUID: nvidia-smi numbers GPUs its own way, not as
    CUDA_VISIBLE_DEVICES does) every `interval_ms` in the background, from `start()` to `stop()`,
    which returns its readings."""

    def __init__(self, gpu: str, interval_ms: int) -> None:
        def supported(fields: Sequence[str]) -> str:
            return next((f for f in fields if _nvidia_smi(f"--query-gpu={f}", f"--id={gpu}")), fields[0])

        query = FIELDS.format(power=supported(POWER_FIELDS), reasons=supported(REASON_FIELDS))
        self.command = [
            "nvidia-smi",
            f"--query-gpu={query}",
            "--format=csv,noheader,nounits",
            f"--loop-ms={interval_ms}",
            f"--id={gpu}",
        ]
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def stop(self) -> list[Sample]:
        assert self.process is not None
        self.process.terminate()
        out, err = self.process.communicate(timeout=30)
        samples = parse_samples(out)
        if not samples:
            raise RuntimeError(f"nvidia-smi gave no readings: {err.strip()[-500:]}")
        return samples


def run_blocks(
    config: str,
    host: str,
    blocks: int,
    steps: int,
    interval_ms: int,
    modes: Sequence[str] = DEFAULT_MODES,
    quantization: str = "none",
) -> list[Block]:
    """The blocks of one config (see the module docstring), `modes` taking turns, its blocks' Linears
    quantized by torchao as `quantization` says (diffusers' host; the floor is then the scaled GEMMs')."""
    import functools

    import torch

    from .floor import floor_step
    from .step import Subject
    from .timing import event_ms

    subject = Subject(config, host, None, "none", quantization)
    run = subject.runner(subject.inputs(1, 4096, 512, 64))
    steps_of: dict[str, Callable[[], object]] = {
        "eager": functools.partial(run, False),
        "fused": functools.partial(run, True),
    }
    uuid = torch.cuda.get_device_properties(torch.cuda.current_device()).uuid
    sampler = Sampler(f"GPU-{uuid}", interval_ms)
    spans = []
    with torch.inference_mode():
        for mode in ("eager", "fused"):  # warm-up; the fused one self-checks
            steps_of[mode]()
        if "floor" in modes:
            steps_of["floor"] = floor_step(steps_of["fused"], subject.model)
        sampler.start()
        for i in range(-1, blocks):  # block -1: the unreported lead-in, of the last mode
            mode = modes[i % len(modes)]
            if mode != "floor":
                subject.switch(mode == "fused")
            torch.cuda.synchronize()
            begin = time.time()
            _, ms = event_ms(lambda step=steps_of[mode]: [step() for _ in range(steps)])
            spans.append((mode, begin, time.time(), ms / steps))
        samples = sampler.stop()
    return [
        summarize(mode, steps, step_ms, [s for s in samples if begin <= s.time <= end])
        for mode, begin, end, step_ms in spans[1:]
    ]


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser("clocks", __doc__)
    add_configs_argument(parser, STEP_CONFIGS, ["klein-4b"])
    parser.add_argument("--host", choices=("package", "diffusers"), default="package")
    parser.add_argument("--blocks", type=int, default=6, help="blocks of steps, the modes taking turns")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=list(DEFAULT_MODES),
        help="the modes taking turns (default eager fused); floor: the fused step's GEMM and attention "
        "calls alone, replayed from a CUDA graph (bench.floor)",
    )
    parser.add_argument("--steps", type=int, default=30, help="pipelined steps a block (default 30)")
    parser.add_argument("--interval-ms", type=int, default=20, help="nvidia-smi's sampling period")
    parser.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        default="none",
        help="--host diffusers: torchao's quantization of the blocks' Linears, as the step benchmark's",
    )
    parser.add_argument("--json", help="write the blocks to this file")
    args = parser.parse_args(argv)
    if min(args.blocks, args.steps, args.interval_ms) < 1:
        parser.error("--blocks, --steps and --interval-ms must be at least 1")
    if args.host == "package" and (why := no_package_model(args.configs)) is not None:
        parser.error(f"{why}; run it with --host diffusers")
    if args.quantize != "none" and args.host != "diffusers":
        parser.error("--quantize needs --host diffusers")
    results = {}
    for config in args.configs:
        results[config] = run_blocks(
            config, args.host, args.blocks, args.steps, args.interval_ms, args.modes, args.quantize
        )
        print(format_blocks(config, results[config]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({c: [asdict(b) for b in bs] for c, bs in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
