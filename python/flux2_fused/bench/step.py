"""Whole-transformer benchmark: one denoise step (one forward) at 1024x1024, eager vs fused.

    python -m flux2_fused.bench.step [--configs dev klein-4b] [--steps N] [--compile] [--json FILE]

Random weights built on the GPU; the same model runs with `fused = False` and `fused = True` on the
same inputs, interleaved step by step, after a warm-up step of each (the fused one self-checks).
Two timings, each of N pairs (CUDA events):
- synchronized: every step starts on an idle GPU and is waited for, so it includes the time the
  GPU spends waiting for the host to launch the step's first kernels;
- pipelined: the steps are enqueued back to back and waited for once at the end, as a denoise loop
  runs them (diffusers' pipelines do not synchronize between steps); with the host ahead of the
  GPU, this is the step's GPU time.
Each reports the median step time per mode, the speedup, the mean of the paired differences with
its 95% confidence interval and how many pairs the fused step won. Also: CUDA kernel launches per
step (torch.profiler), the fused-kernel launches, and the SHA-256 of both outputs (identical when
the fused path is bit-exact).

With --compile both modes run through `torch.compile(model)` (one compiled graph per mode): the
compiled tier, where the fused sites are flux2_fused operators and the fast-path-off graph uses
Inductor's own fusion of the chain. Compiled outputs differ from eager (Inductor is not bit-exact),
so there the hashes are reported, not compared. The compiled tier's gain is small next to the
step-to-step spread (klein-4b: ~0.5 ms against a standard deviation of the paired difference of ~1 ms
synchronized, ~0.3 ms pipelined), so --compile defaults to 100 pairs.
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from ..models.flux2 import Flux2Config, Flux2Transformer, image_ids, text_ids
from .timing import event_ms

FUSED_KERNEL = "gated_resnorm_kernel"


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (as stored), so equal hashes mean bit-identical results."""
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def kernel_launches(fn: Callable[[], object]) -> tuple[int, int]:
    """(all CUDA kernels, fused-kernel launches) that one call of `fn` runs, counted by torch.profiler."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels), sum(FUSED_KERNEL in e.name for e in kernels)


def step_inputs(
    config: Flux2Config, batch: int, img_tokens: int, txt_tokens: int, dtype: torch.dtype
) -> dict:
    """Fresh random latents and text embeddings with FLUX.2's position ids, on the GPU."""
    return {
        "hidden_states": torch.randn(batch, img_tokens, config.in_channels, device="cuda", dtype=dtype),
        "encoder_hidden_states": torch.randn(
            batch, txt_tokens, config.joint_attention_dim, device="cuda", dtype=dtype
        ),
        "timestep": torch.full((batch,), 0.5, device="cuda"),
        "img_ids": image_ids(img_tokens, device="cuda"),
        "txt_ids": text_ids(txt_tokens, device="cuda"),
        "guidance": torch.full((batch,), 4.0, device="cuda") if config.guidance_embeds else None,
    }


@dataclass
class Timing:
    """Interleaved step times of the two modes: medians and the paired (same position) difference."""

    eager_ms: float
    fused_ms: float
    speedup_pct: float
    paired_diff_ms: float  # mean over pairs of (eager - fused)
    paired_ci95_ms: float  # half-width of its 95% confidence interval
    fused_won: int  # pairs where the fused step was faster

    @classmethod
    def of(cls, times: dict[bool, list[float]]) -> Timing:
        eager_ms, fused_ms = statistics.median(times[False]), statistics.median(times[True])
        diffs = [e - f for e, f in zip(times[False], times[True], strict=True)]
        ci95 = 1.96 * statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
        return cls(
            eager_ms=eager_ms,
            fused_ms=fused_ms,
            speedup_pct=100 * (eager_ms / fused_ms - 1),
            paired_diff_ms=statistics.mean(diffs),
            paired_ci95_ms=ci95,
            fused_won=sum(d > 0 for d in diffs),
        )


def _pair_order(pairs: int) -> list[bool]:
    """The modes in run order: (eager, fused), then (fused, eager), ..., so drift hits both alike."""
    return [mode for i in range(pairs) for mode in ((False, True) if i % 2 == 0 else (True, False))]


def time_synchronized(run: Callable[[bool], object], pairs: int) -> dict[bool, list[float]]:
    """Each step alone from an idle GPU (synchronized after every step): includes the time the GPU
    waits for the host to launch the step's first kernels."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for mode in _pair_order(pairs):
        times[mode].append(event_ms(functools.partial(run, mode))[1])
    return times


def time_pipelined(run: Callable[[bool], object], pairs: int) -> dict[bool, list[float]]:
    """Steps enqueued back to back, as a denoise loop enqueues them (diffusers' pipelines do not
    synchronize between steps): one synchronization at the end, each step timed between the CUDA
    events around it. Once the host runs ahead this is the step's GPU time, launch gaps included."""
    order = _pair_order(pairs)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(order) + 1)]
    run(False)  # untimed lead-in: the host gets ahead of the GPU before the first timed step
    marks[0].record()
    for mode, mark in zip(order, marks[1:], strict=True):
        run(mode)
        mark.record()
    marks[-1].synchronize()
    times: dict[bool, list[float]] = {False: [], True: []}
    for mode, start, end in zip(order, marks, marks[1:], strict=False):
        times[mode].append(start.elapsed_time(end))
    return times


@dataclass
class StepResult:
    config: str
    batch: int
    steps: int  # pairs of steps in each timing
    img_tokens: int
    txt_tokens: int
    synchronized: Timing
    pipelined: Timing
    eager_kernels: int
    fused_kernels: int
    fused_kernel_launches: int
    eager_sha256: str
    fused_sha256: str
    bit_exact: bool
    compiled: bool = False


def bench_config(
    name: str, steps: int, batch: int, img_tokens: int, txt_tokens: int, compiled: bool = False
) -> StepResult:
    config = Flux2Config.preset(name)
    model = Flux2Transformer.random(config, seed=0, device="cuda", dtype=torch.bfloat16)
    inputs = step_inputs(config, batch, img_tokens, txt_tokens, torch.bfloat16)
    forward = torch.compile(model) if compiled else model

    def run(fused: bool) -> torch.Tensor:
        model.fused = fused
        return forward(**inputs)

    with torch.inference_mode():
        outputs = {mode: run(mode) for mode in (False, True)}  # warm-up; the fused one self-checks
        synchronized = Timing.of(time_synchronized(run, steps))
        pipelined = Timing.of(time_pipelined(run, steps))
        eager_kernels, _ = kernel_launches(lambda: run(False))
        fused_kernels, fused_launches = kernel_launches(lambda: run(True))
    return StepResult(
        config=name,
        batch=batch,
        steps=steps,
        img_tokens=img_tokens,
        txt_tokens=txt_tokens,
        synchronized=synchronized,
        pipelined=pipelined,
        eager_kernels=eager_kernels,
        fused_kernels=fused_kernels,
        fused_kernel_launches=fused_launches,
        eager_sha256=tensor_sha256(outputs[False]),
        fused_sha256=tensor_sha256(outputs[True]),
        bit_exact=torch.equal(outputs[False], outputs[True]),
        compiled=compiled,
    )


def format_table(results: list[StepResult]) -> str:
    lines = [
        f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  bf16, random weights"
        + (
            "  torch.compile(model): bit-exact column compares two compiled graphs"
            if results[0].compiled
            else ""
        ),
        "| config | B | tokens (img+txt) | timing | eager ms | fused ms | speedup | paired gain ms (95% CI) "
        "| fused won | kernels/step eager -> fused | fused launches | bit-exact | SHA-256 (both) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        sha = r.fused_sha256[:16] if r.bit_exact else f"{r.eager_sha256[:12]} / {r.fused_sha256[:12]}"
        for label, t in (("synchronized", r.synchronized), ("pipelined", r.pipelined)):
            gain = f"{t.paired_diff_ms:+.2f} +- {t.paired_ci95_ms:.2f}"
            lines.append(
                f"| {r.config} | {r.batch} | {r.img_tokens}+{r.txt_tokens} | {label} | {t.eager_ms:.2f} "
                f"| {t.fused_ms:.2f} | {t.speedup_pct:+.1f}% | {gain} | {t.fused_won}/{r.steps} "
                f"| {r.eager_kernels} -> {r.fused_kernels} | {r.fused_kernel_launches} "
                f"| {'yes' if r.bit_exact else 'NO'} | {sha} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs", nargs="*", default=["dev", "klein-4b"], choices=["dev", "klein-4b", "klein-9b"]
    )
    parser.add_argument("--steps", type=int, help="timed steps per mode (default 7, with --compile 100)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--img-tokens", type=int, default=4096, help="4096 = 1024x1024")
    parser.add_argument("--txt-tokens", type=int, default=512)
    parser.add_argument("--compile", action="store_true", help="both modes under torch.compile(model)")
    parser.add_argument("--json", help="write the results to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("flux2-fused step benchmark: needs a CUDA GPU", file=sys.stderr)
        return 2
    results = []
    steps = args.steps or (100 if args.compile else 7)
    for name in args.configs:
        results.append(
            bench_config(name, steps, args.batch, args.img_tokens, args.txt_tokens, compiled=args.compile)
        )
        gc.collect()  # drop the previous model (dev is 64 GB) before building the next
        torch.cuda.empty_cache()
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([asdict(r) for r in results], fh, indent=2)
    return 0 if args.compile or all(r.bit_exact for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
