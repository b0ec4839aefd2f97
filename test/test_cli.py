"""CPU tests of the `flux2-fused` command: bench at the tiny config, its JSON and PNG, every error path,
the GPU-only commands' refusals, and a --help that imports no torch. Timings are printed, never
asserted."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import importlib
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flux2_fused.bench import denoise, options, plot
from flux2_fused.bench.classify import kernel_class
from flux2_fused.bench.results.bench import BenchReport, ModeResult
from flux2_fused.bench.results.kernel import KernelReport, KernelRow
from flux2_fused.bench.results.parallel import ParallelResult
from flux2_fused.bench.results.pipeline import PipelineResult
from flux2_fused.bench.results.step import StepResult
from flux2_fused.bench.results.tables import INACTIVE, MODES, SITES, Paired, Timing
from flux2_fused.bench.results.verify import VerifyRow
from flux2_fused.cli import PROG, Parser, build_parser, main
from flux2_fused.models.flux2 import Flux2Config, Flux2Transformer
from flux2_fused.models.weights import WeightsError
from flux2_fused.ops import OPS, jit

PYTHON_DIR = Path(__file__).resolve().parents[1] / "python"
# For `python -m ...` in a subprocess: this tree's package, installed or not.
SUBPROCESS_ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(PYTHON_DIR), os.environ.get("PYTHONPATH", "")]),
}
# Small enough for milliseconds a step, with a non-square image grid and a batch of two.
TINY_ARGS = ["--config", "tiny", "--height", "64", "--width", "96", "--steps", "3", "--text-tokens", "24"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks what happens on a machine without a CUDA GPU"
)
needs_matplotlib = pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="needs matplotlib (pip install matplotlib)")


def run_cli(args: list[str]) -> tuple[int, str, str]:
    """main(args) in-process: (exit status, stdout, stderr); argparse's SystemExit becomes the status."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


REPORT_TYPES = [
    BenchReport,
    ModeResult,
    Timing,
    Paired,
    StepResult,
    PipelineResult,
    ParallelResult,
    KernelRow,
    KernelReport,
    VerifyRow,
]


def documented_fields(cls: type) -> set[str]:
    """The fields a report dataclass's docstring documents, one `- name: meaning` line each."""
    return set(re.findall(r"^\s*- (\w+):", cls.__doc__ or "", re.MULTILINE))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One in-process `bench` at the tiny config, batch 2, with --json and --plot, shared by the tests."""
    folder = tmp_path_factory.mktemp("bench")
    json_path, png_path = folder / "report.json", folder / "report.png"
    plot = ["--plot", str(png_path)] if HAVE_MATPLOTLIB else []  # the [test] extra installs it
    code, out, err = run_cli(["bench", *TINY_ARGS, "--batch", "2", "--json", str(json_path), *plot])
    return {"code": code, "out": out, "err": err, "json": json_path, "png": png_path}


def test_bench_tiny_runs_and_reports(tiny_run: dict) -> None:
    assert tiny_run["code"] == 0, tiny_run["err"]
    out = tiny_run["out"]
    assert "flux2-fused bench: tiny" in out
    assert "64x96 px = 24 image + 24 text tokens, batch 2" in out
    assert re.search(r"^\| eager \|", out, re.MULTILINE) and re.search(r"^\| fused \|", out, re.MULTILINE)
    assert "bit-exact: yes" in out
    shas = re.findall(r"sha256 (eager|fused) ([0-9a-f]{64})", out)
    assert [mode for mode, _ in shas] == ["eager", "fused"] and shas[0][1] == shas[1][1]


@pytest.mark.parametrize("cls", REPORT_TYPES, ids=lambda cls: cls.__name__)
def test_report_fields_are_documented_on_their_class(cls: type) -> None:
    assert documented_fields(cls) == {field.name for field in dataclasses.fields(cls)}


def test_json_has_every_documented_field(tiny_run: dict) -> None:
    report = json.loads(tiny_run["json"].read_text())
    top, per_mode = documented_fields(BenchReport), documented_fields(ModeResult)
    assert len(top) > 20 and len(per_mode) >= 7  # the docstring's lists were found
    assert set(report) == top
    for mode in MODES:
        result = report[mode]
        assert set(result) == per_mode
        assert len(result["step_ms"]) == report["steps"] == 3
        assert set(result["site_ms"]) == set(result["site_launches"]) == set(SITES)
        assert sum(result["site_launches"].values()) == result["launches_per_step"] > 0
    assert (report["config"], report["dtype"], report["batch"]) == (
        "tiny",
        "fp32" if report["gpu"] is None else "bf16",
        2,
    )
    assert (report["image_tokens"], report["text_tokens"], report["guidance"]) == (4 * 6, 24, 4.0)
    assert report["bit_exact"] and report["eager"]["sha256"] == report["fused"]["sha256"]
    if report["gpu"] is None:
        assert not report["fused_active"] and "CUDA" in report["fused_status"]


def test_no_speedup_is_claimed_without_the_fast_path(tiny_run: dict) -> None:
    """Without the fast path both modes run the same eager code: a "speedup" would be noise."""
    report = json.loads(tiny_run["json"].read_text())
    fused_row = next(line for line in tiny_run["out"].splitlines() if line.startswith("| fused |"))
    speedup_cell = fused_row.split("|")[3].strip()
    if report["fused_active"]:
        assert speedup_cell.endswith("%") and report["speedup_pct"] is not None
    else:
        assert speedup_cell == INACTIVE and report["speedup_pct"] is None


@needs_matplotlib
def test_plot_title_says_when_the_fast_path_was_inactive(
    tiny_run: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from matplotlib.figure import Figure

    titles: list[str] = []
    real = Figure.suptitle
    monkeypatch.setattr(
        Figure, "suptitle", lambda fig, text, **kw: titles.append(text) or real(fig, text, **kw)
    )
    data = json.loads(tiny_run["json"].read_text())
    modes = {mode: ModeResult(**data.pop(mode)) for mode in MODES}
    report = BenchReport(**data, **modes)
    plot.save_plot(dataclasses.replace(report, speedup_pct=None), tmp_path / "a.png")
    plot.save_plot(dataclasses.replace(report, speedup_pct=4.3), tmp_path / "b.png")
    assert f"fused {INACTIVE}" in titles[0] and "fused +4.3%" in titles[1]


@needs_matplotlib
def test_plot_is_a_png_matplotlib_reads(tiny_run: dict) -> None:
    png = tiny_run["png"]
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    image = importlib.import_module("matplotlib.image").imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


@no_cuda
def test_default_bench_picks_tiny_on_the_cpu() -> None:
    code, out, err = run_cli(["bench"])
    assert code == 0, err
    assert re.search(
        r"^flux2-fused: the fast path is off here \(.*CUDA.*\): both modes run eager PyTorch$", err, re.M
    )
    assert "flux2-fused bench: tiny" in out and f"{denoise.CPU_SIDE}x{denoise.CPU_SIDE} px" in out
    assert "bit-exact: yes" in out


@no_cuda
def test_the_cpu_warm_up_says_both_modes_are_eager(tiny_run: dict) -> None:
    """Nothing is built on the CPU: the fused warm-up must not claim a kernel build or load."""
    warmup = next(line for line in tiny_run["err"].splitlines() if "warm-up step, fused" in line)
    assert warmup.endswith(" (the fast path is off here: the same eager PyTorch as the eager mode)")
    assert "builds or loads" not in tiny_run["err"]


@no_cuda
def test_the_cpu_run_says_how_to_read_its_figures(tiny_run: dict) -> None:
    """Both modes ran eager: the spread of the timed steps and what steadies them, what the site
    columns split, and why the op counts differ."""
    report = json.loads(tiny_run["json"].read_text())
    notes = [
        line.removeprefix("note: ") for line in tiny_run["out"].splitlines() if line.startswith("note: ")
    ]
    noise, columns, *counts = notes
    assert noise.startswith("both modes ran the same eager code, so the gap between their medians is noise")
    for mode in MODES:
        times = report[mode]["step_ms"]
        assert f"{min(times):.1f}-{max(times):.1f} ms ({mode})" in noise
    assert f"on {torch.get_num_threads()} CPU threads" in noise and "OMP_NUM_THREADS=1" in noise
    assert "more --steps" in noise
    assert columns.startswith("the fused, norm, elementwise, other ms columns split one more step, run under")
    assert f"{sum(report['eager']['site_ms'].values()):.2f} ms eager" in columns
    eager, fused = report["eager"]["launches_per_step"], report["fused"]["launches_per_step"]
    if eager == fused:
        assert counts == []
    else:
        assert counts == [
            f"aten ops/step differ ({eager} eager, {fused} fused) though both ran eager: the fused mode's "
            "code writes each single block's attention and MLP outputs into the halves of one buffer "
            "(empty, copy_) where eager concatenates them (cat); the arithmetic is the same"
        ]


def test_an_active_gpu_run_needs_no_reading_notes(tiny_run: dict) -> None:
    data = json.loads(tiny_run["json"].read_text())
    modes = {mode: ModeResult(**data.pop(mode)) for mode in MODES}
    report = BenchReport(**data, **modes)
    active = dataclasses.replace(report, gpu="NVIDIA H200", fused_active=True, speedup_pct=30.0)
    assert denoise.reading_notes(active) == []
    inactive = denoise.reading_notes(dataclasses.replace(report, gpu="NVIDIA H200"))
    assert inactive[0].startswith("both modes ran the same eager code") and "CPU threads" not in inactive[0]
    assert not any("profiler" in note for note in inactive)  # a GPU's columns are kernel time


@no_cuda
def test_a_cpu_run_that_cannot_fit_is_refused_up_front(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(denoise, "available_ram_bytes", lambda: 3 * 10**9)
    code, out, err = run_cli(["bench", "--config", "klein-4b"])
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert re.match(
        r"flux2-fused: error: --config klein-4b in fp32 needs about 1\d\.\d GB of memory \(an estimate\) "
        r"and this machine has 3\.0 GB available",
        err,
    ), err


def _estimate(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Make the CPU run's time estimate `seconds`, without measuring this CPU."""
    monkeypatch.setattr(denoise, "cpu_seconds", lambda *args: (seconds, "made up for the test"))


@no_cuda
def test_a_slow_cpu_run_is_announced_with_an_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    _estimate(monkeypatch, 10 * 60)
    code, _out, err = run_cli(["bench", *TINY_ARGS])
    assert code == 0, err
    assert re.search(r"^flux2-fused: estimate: this run takes roughly 10 min on this CPU", err, re.MULTILINE)


@no_cuda
def test_a_cpu_run_over_an_hour_is_refused_without_allow_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    _estimate(monkeypatch, 37 * 3600)
    code, out, err = run_cli(["bench", *TINY_ARGS])
    assert (
        code == 2
        and out == ""
        and err
        == (
            "flux2-fused: error: --config tiny in fp32 would take roughly 37.0 h on this CPU (an estimate: "
            "made up for the test); --config tiny takes seconds, --allow-slow starts it anyway\n"
        )
    )


@no_cuda
def test_allow_slow_starts_a_run_over_an_hour(monkeypatch: pytest.MonkeyPatch) -> None:
    _estimate(monkeypatch, 37 * 3600)
    code, out, err = run_cli(["bench", *TINY_ARGS, "--allow-slow"])
    assert code == 0 and "bit-exact: yes" in out, err
    assert "flux2-fused: estimate: this run takes roughly 37.0 h on this CPU" in err


@no_cuda
def test_a_quick_cpu_run_has_no_estimate(tiny_run: dict) -> None:
    assert "estimate" not in tiny_run["err"]


def test_entry_point_python_m() -> None:
    args = [
        "bench",
        "--config",
        "tiny",
        "--height",
        "32",
        "--width",
        "32",
        "--steps",
        "1",
        "--text-tokens",
        "8",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "flux2_fused", *args],
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "bit-exact: yes" in proc.stdout


# What `flux2-fused --help` may import of the package: the command line and its torch-free options.
HELP_MODULES = {"flux2_fused", "flux2_fused.cli", "flux2_fused.bench", "flux2_fused.bench.options"}
HELP_MODULES |= {"flux2_fused.errors", "flux2_fused.__main__"}


@pytest.mark.parametrize(
    "command", [[], ["bench"], ["step"], ["pipeline"], ["kernel"], ["verify"], ["build"]]
)
def test_help_imports_no_torch(command: list[str]) -> None:
    """--help answers at once: no torch, diffusers or benchmark module is imported to print it (-X
    importtime lists every module imported, one a line, its name last)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "flux2_fused", *command, "--help"],
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.startswith(f"usage: {' '.join([PROG, *command])} ")
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "flux2_fused.cli" in imported  # the list was read
    assert not imported & {"torch", "diffusers", "numpy"}
    assert {name for name in imported if name.startswith("flux2_fused")} <= HELP_MODULES


def test_bench_from_a_weights_folder(tmp_path: Path) -> None:
    Flux2Transformer.random(Flux2Config.preset("tiny"), seed=5).save_pretrained(tmp_path / "weights")
    json_path = tmp_path / "report.json"
    args = ["bench", "--weights", str(tmp_path / "weights"), *TINY_ARGS[2:], "--json", str(json_path)]
    code, _out, err = run_cli(args)
    assert code == 0, err
    report = json.loads(json_path.read_text())
    assert report["config"] == "tiny" and report["weights"] == str(tmp_path / "weights")


def _malformed_weights(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text('{"num_layers": "eight"}')
    return tmp_path


def _pipeline_folder(tmp_path: Path) -> Path:
    """A diffusers pipeline root: model_index.json and one folder a component."""
    (tmp_path / "model_index.json").write_text('{"_class_name": "Flux2Pipeline"}')
    (tmp_path / "transformer").mkdir()
    return tmp_path


def _vae_folder(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text('{"_class_name": "AutoencoderKLFlux2", "latent_channels": 32}')
    return tmp_path


def test_a_pipeline_folder_points_at_its_transformer(tmp_path: Path) -> None:
    code, _out, err = run_cli(["bench", "--weights", str(_pipeline_folder(tmp_path))])
    assert (
        code == 2
        and err == f"flux2-fused: error: {tmp_path} is a pipeline folder; pass {tmp_path / 'transformer'}\n"
    )


def test_weights_that_do_not_match_their_config_exit_2(tmp_path: Path) -> None:
    """Found while loading, after the plan: still the --weights argument's fault, so still 2."""
    Flux2Transformer.random(Flux2Config.preset("tiny"), seed=5).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_layers": 3}))
    code, _out, err = run_cli(["bench", "--weights", str(tmp_path), *TINY_ARGS[2:]])
    assert code == 2 and "missing keys" in err.splitlines()[-1], err


@pytest.mark.parametrize(
    ("make_args", "code", "message"),
    [
        (lambda tmp: ["--weights", str(tmp / "missing")], 2, "does not exist"),
        (lambda tmp: ["--weights", str(_malformed_weights(tmp))], 2, "config.json: invalid num_layers"),
        (lambda tmp: ["--weights", str(_pipeline_folder(tmp))], 2, "is a pipeline folder; pass "),
        (
            lambda tmp: ["--weights", str(_vae_folder(tmp))],
            2,
            "config.json describes AutoencoderKLFlux2, not a FLUX.2 transformer (Flux2Transformer2DModel)",
        ),
        (lambda tmp: ["--height", "1000"], 2, "--height 1000 is not a positive multiple of 16"),
        (lambda tmp: ["--width", "0"], 2, "--width 0 is not a positive multiple of 16"),
        (lambda tmp: ["--steps", "0"], 2, "--steps must be at least 1"),
        (lambda tmp: ["--batch", "-1"], 2, "--batch must be at least 1"),
        (lambda tmp: ["--json", str(tmp / "no-such-folder" / "r.json")], 2, "does not exist"),
    ],
    ids=[
        "missing-weights",
        "malformed-weights",
        "pipeline-folder",
        "vae-folder",
        "height",
        "width",
        "steps",
        "batch",
        "json-folder",
    ],
)
def test_bench_errors_are_one_line(tmp_path: Path, make_args, code: int, message: str) -> None:
    status, out, err = run_cli(["bench", *make_args(tmp_path)])
    assert status == code
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("flux2-fused: error: ") and message in errors[0], err
    assert "Traceback" not in err and "bit-exact" not in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["bench", "--config", "klein4b"],
            "argument --config/--configs: invalid choice: 'klein4b' (choose from dev, klein-4b, klein-9b, "
            "tiny)",
        ),
        (
            ["bench", "--config", "tiny", "--weights", "w"],
            "argument --weights: not allowed with argument --config/--configs",
        ),
        (
            ["step", "--config", "dev", "--weights", "w"],
            "argument --weights: not allowed with argument --config/--configs",
        ),
        (["bench", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["bench", "--steps", "two"], "argument --steps: invalid int value: 'two'"),
        (
            ["bench", "--dtype", "fp8"],
            "argument --dtype: invalid choice: 'fp8' (choose from bf16, fp16, fp32)",
        ),
        (
            ["step", "--config", "tiny"],
            "argument --config/--configs: invalid choice: 'tiny' "
            "(choose from dev, klein-4b, klein-9b, flux1-dev, flux1-schnell, flux3-klein, flux3-klein-flow, "
            "qwen-image, z-image-turbo)",
        ),
        (["step", "--configs"], "argument --config/--configs: expected at least one argument"),
        (
            ["step", "--sizes", "1024"],
            "argument --sizes: '1024' is not WIDTHxHEIGHT in pixels, e.g. 1360x768",
        ),
        (
            ["step", "--sizes", "1024x1000"],
            "argument --sizes: 1024x1000: 1000 is not a positive multiple of 16 (FLUX.2 has one latent "
            "token per 16x16 pixels)",
        ),
        (
            ["step", "--sizes", "512x512", "--img-tokens", "64"],
            "argument --img-tokens: not allowed with argument --sizes",
        ),
        (
            ["step", "--host", "comfy"],
            "argument --host: invalid choice: 'comfy' (choose from package, diffusers, comfyui)",
        ),
        (
            ["pipeline", "--config", "klein-8b"],
            "argument --config/--configs: invalid choice: 'klein-8b' "
            "(choose from klein-4b, klein-9b, dev, flux1-dev, flux1-schnell, flux3-klein, flux3-klein-flow)",
        ),
        (
            ["kernel", "--op", "rmsnorm"],
            "argument --op: invalid choice: 'rmsnorm' "
            "(choose from gated_resnorm, qk_norm_rope, sandwich_norm, swiglu, gelu_tanh, float8_quant, "
            "uniform_rows)",
        ),
        (["kernel", "--shapes"], "argument --shapes: expected at least one argument"),
        (["verify", "--all"], "unrecognized arguments: --all"),
        (["build", "--arch"], "argument --arch: expected at least one argument"),
        (
            ["build", "--arch", "hopper"],
            "argument --arch: unrecognized CUDA architecture 'hopper' (expected e.g. 9.0, 10.0, sm_90)",
        ),
        (
            ["frobnicate"],
            "argument {bench,step,pipeline,kernel,verify,build}: invalid choice: 'frobnicate' "
            "(choose from bench, step, pipeline, kernel, verify, build)",
        ),
        ([], "the following arguments are required: {bench,step,pipeline,kernel,verify,build}"),
    ],
    ids=[
        "unknown-config",
        "config-and-weights",
        "step-config-and-weights",
        "unknown-option",
        "not-a-number",
        "unknown-dtype",
        "step-config",
        "step-no-configs",
        "step-size-form",
        "step-size-multiple",
        "step-sizes-and-tokens",
        "step-host",
        "pipeline-config",
        "kernel-op",
        "kernel-no-shapes",
        "verify-option",
        "build-no-arch",
        "bad-arch",
        "unknown-command",
        "no-command",
    ],
)
def test_usage_errors_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    """argparse's own errors too: one line naming the choices where there are choices, no usage."""
    code, out, err = run_cli(args)
    assert (code, out, err) == (2, "", f"flux2-fused: error: {message}\n")


def test_choices_read_alike_on_every_python() -> None:
    """Python before 3.12.8 quotes each choice in argparse's message, later ones do not: one form."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        Parser(prog="flux2-fused x").error("argument --op: invalid choice: 'a' (choose from 'b', 'c')")
    assert exit_info.value.code == 2
    assert err.getvalue() == "flux2-fused: error: argument --op: invalid choice: 'a' (choose from b, c)\n"


@pytest.mark.parametrize("debug_first", [True, False], ids=["before-command", "after-command"])
def test_debug_shows_the_traceback_with_the_same_exit_status(tmp_path: Path, debug_first: bool) -> None:
    bench = ["bench", "--weights", str(tmp_path / "missing")]
    code, out, err = run_cli(["--debug", *bench] if debug_first else [*bench, "--debug"])
    assert code == 2 and out == "" and err.startswith("Traceback (most recent call last):")
    raised = re.escape(f"{WeightsError.__module__}.{WeightsError.__qualname__}")
    assert re.search(rf"^{raised}: .*does not exist", err, re.MULTILINE), err


VERIFY_HEAD = "flux2-fused verify: no CUDA GPU here, so no self-check; each op's module would come from:"


def _module_rows(out: str) -> dict[str, str]:
    """`verify`'s table without a GPU: op -> where its module would come from."""
    rows = dict(re.findall(r"^\| (\w+) \| (.*) \|$", out, re.MULTILINE))
    assert rows.pop("op") == "module on a CUDA GPU"
    return rows


@no_cuda
@pytest.mark.parametrize("debug", [[], ["--debug"]], ids=["plain", "debug"])
def test_verify_without_cuda_says_where_modules_come_from_then_exits_2(debug: list[str]) -> None:
    code, out, err = run_cli([*debug, "verify"])
    assert code == 2 and out.splitlines()[0] == VERIFY_HEAD
    assert list(_module_rows(out)) == [op.name for op in OPS]
    assert err.strip().splitlines()[-1].endswith("verify needs a CUDA GPU and none is available")
    assert ("Traceback" in err) == bool(debug)


@no_cuda
@pytest.mark.parametrize("toolkit", [False, True], ids=["no-toolkit", "toolkit"])
def test_verify_without_cuda_shows_the_installed_bundle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, toolkit: bool
) -> None:
    """The wheel just built and installed, on a machine without a GPU: the bundle's architectures from
    its manifest for each op it holds from these sources; a module built from other sources, or none,
    is not counted, and the op falls to the JIT build or to none."""
    folder = tmp_path / "prebuilt"
    folder.mkdir()
    modules = {}
    for op, sources in zip(OPS[:3], ["same", "same", "0" * 64], strict=True):
        (folder / op.spec.library).write_bytes(b"module")
        digest = jit.source_digest(op.spec) if sources == "same" else sources
        modules[op.name] = {
            "library": op.spec.library,
            "sources": digest,
            "archs": ["9.0", "10.0"],
            "ptx": "10.0",
        }
    (folder / jit.BUNDLE_MANIFEST).write_text(json.dumps({"modules": modules}))
    monkeypatch.setattr(jit, "BUNDLE_DIR", folder)
    monkeypatch.setattr(jit, "loader_reason", lambda: None)
    monkeypatch.setattr(jit, "toolchain_reason", lambda: None if toolkit else "nvcc not found")
    monkeypatch.setattr(jit, "find_nvcc", lambda: "/opt/cuda/bin/nvcc")
    monkeypatch.setenv(jit.CACHE_ENV, str(tmp_path / "cache"))
    code, out, err = run_cli(["verify"])
    assert code == 2 and err == "flux2-fused: error: verify needs a CUDA GPU and none is available\n"
    built = f"a JIT build with nvcc at /opt/cuda/bin/nvcc (cached in {tmp_path / 'cache'})"
    fallback = built if toolkit else "none: no bundled module, and nvcc not found"
    bundled = [f"bundled ({op.spec.library}): sm 9.0 10.0, PTX 10.0 for newer GPUs" for op in OPS[:2]]
    assert (
        _module_rows(out)
        == {
            OPS[0].name: f"{bundled[0]}, else {built}" if toolkit else bundled[0],
            OPS[1].name: f"{bundled[1]}, else {built}" if toolkit else bundled[1],
            OPS[2].name: fallback,  # its bundled module was built from other sources
            **{op.name: fallback for op in OPS[3:]},  # not in the bundle
        }
    )


@no_cuda
def test_verify_without_cuda_or_tvm_ffi_says_why_no_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jit, "loader_reason", lambda: "apache-tvm-ffi is not installed")
    code, out, _err = run_cli(["verify"])
    assert code == 2
    assert set(_module_rows(out).values()) == {"none: apache-tvm-ffi is not installed"}


@pytest.mark.parametrize(
    ("exc", "message"),
    [
        (
            torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64 GiB\nmore detail"),
            "out of GPU memory",
        ),
        (RuntimeError("boom"), "RuntimeError: boom"),
    ],
    ids=["oom", "unexpected"],
)
def test_runtime_errors_are_one_line(monkeypatch: pytest.MonkeyPatch, exc: Exception, message: str) -> None:
    def fail(_plan: denoise.Plan) -> None:
        raise exc

    monkeypatch.setattr(denoise, "build_model", fail)
    code, _out, err = run_cli(["bench", *TINY_ARGS])
    last = err.strip().splitlines()[-1]
    assert code == 1 and last.startswith("flux2-fused: error: ") and message in last
    assert "Traceback" not in err
    code, _out, err = run_cli(["--debug", "bench", *TINY_ARGS])
    assert (
        code == 1 and "Traceback" in err and err.strip().splitlines()[-1].endswith(str(exc).splitlines()[-1])
    )


def test_a_difference_between_the_modes_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The verdict is computed, not assumed: skew the fused mode's latents and the run must fail."""
    real_step = denoise.euler_step

    def skewed_step(model: Flux2Transformer, x: torch.Tensor, *args: object) -> torch.Tensor:
        out = real_step(model, x, *args)
        return out + 1 if model.fused else out

    monkeypatch.setattr(denoise, "euler_step", skewed_step)
    code, out, err = run_cli(["bench", *TINY_ARGS])
    shas = dict(re.findall(r"sha256 (eager|fused) ([0-9a-f]{64})", out))
    assert code == 1 and "bit-exact: NO" in out and shas["eager"] != shas["fused"]
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith("flux2-fused: error: the fused and eager final latents differ")
    )


def assert_refused_before_the_run(args: list[str], message: str) -> None:
    code, out, err = run_cli(["bench", *TINY_ARGS, *args])
    assert code == 2 and out == "" and message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (lambda tmp: ["--json", str(tmp)], "is a folder; give a file name"),
        (lambda tmp: ["--plot", str(tmp / "out.txt")], "must end in .png"),
        (lambda tmp: ["--plot", str(tmp / "noext")], "must end in .png"),
    ],
    ids=["json-is-a-folder", "plot-txt", "plot-no-suffix"],
)
def test_unusable_output_paths_fail_before_the_run(tmp_path: Path, make_args, message: str) -> None:
    assert_refused_before_the_run(make_args(tmp_path), message)
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(
    os.geteuid() == 0, reason="needs a non-root user (root can write in a folder of mode 0500)"
)
def test_output_in_a_read_only_folder_fails_before_the_run(tmp_path: Path) -> None:
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o500)
    assert_refused_before_the_run(
        ["--json", str(folder / "r.json")], f"cannot create a file in folder {folder} (permission denied)"
    )


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("command", ["bench", "step", "pipeline", "kernel"])
def test_output_in_proc_fails_before_the_run(command: str) -> None:
    """/proc takes no new files, even from root: an unwritable folder wherever the tests run. It
    exists, so the error must not say "No such file or directory" (what creating a file there gives)."""
    code, out, err = run_cli([command, "--json", "/proc/nope.json"])
    assert (code, out) == (2, "")
    assert err == (
        "flux2-fused: error: --json /proc/nope.json: cannot create a file in folder /proc "
        "(its file system takes no new files)\n"
    )


@pytest.mark.parametrize(
    ("error", "why"),
    [
        (errno.EACCES, "permission denied"),
        (errno.EROFS, "read-only file system"),
        (errno.ENOENT, "its file system takes no new files"),
        (errno.ENOSPC, os.strerror(errno.ENOSPC)),
    ],
    ids=["access", "read-only", "virtual", "other"],
)
def test_a_refused_output_folder_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int, why: str
) -> None:
    """What the system answers when a file is created in an existing folder, in words (as root too,
    which a folder's mode does not stop)."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(options.tempfile, "NamedTemporaryFile", refuse)
    target = tmp_path / "r.json"
    assert_refused_before_the_run(
        ["--json", str(target)], f"--json {target}: cannot create a file in folder {tmp_path} ({why})"
    )


@pytest.mark.parametrize("below", ["out.json", "sub/out.json"], ids=["in-a-file", "under-a-file"])
@pytest.mark.parametrize("command", ["bench", "step", "pipeline", "kernel"])
def test_output_under_a_file_says_the_file_is_in_the_way(tmp_path: Path, command: str, below: str) -> None:
    """FILE/out.json, FILE a regular file: the folder is not missing, a file stands where it should be."""
    blocker = tmp_path / "report"
    blocker.write_text("not a folder")
    target = blocker / below
    code, out, err = run_cli([command, "--json", str(target)])
    assert (code, out) == (2, "")
    assert err == f"flux2-fused: error: --json {target}: {blocker} is a file, not a folder\n"


def test_plot_under_a_file_is_refused_too(tmp_path: Path) -> None:
    blocker = tmp_path / "plots"
    blocker.write_text("")
    assert_refused_before_the_run(["--plot", str(blocker / "p.png")], f"{blocker} is a file, not a folder")


@pytest.mark.skipif(os.geteuid() == 0, reason="needs a non-root user (root can write a file of mode 0400)")
def test_an_existing_read_only_output_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "r.json"
    target.write_text("{}")
    target.chmod(0o400)
    assert_refused_before_the_run(["--json", str(target)], f"cannot write {target} (permission denied)")


def test_an_existing_output_file_is_kept_until_the_run_writes_it(tmp_path: Path) -> None:
    """The check of an existing file opens it for appending and writes nothing."""
    target = tmp_path / "r.json"
    target.write_text("old")
    code, _out, err = run_cli(["bench", *TINY_ARGS, "--steps", "0", "--json", str(target)])
    assert code == 2 and "--steps must be at least 1" in err
    assert target.read_text() == "old"


def test_the_path_written_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, _out, err = run_cli(["bench", *TINY_ARGS, "--json", "r.json"])
    assert code == 0 and f"flux2-fused: wrote {tmp_path.resolve() / 'r.json'}" in err


def test_plot_without_matplotlib_fails_before_the_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec() then reports it missing
    code, out, err = run_cli(["bench", *TINY_ARGS, "--plot", str(tmp_path / "p.png")])
    assert code == 1 and out == "" and "--plot needs matplotlib" in err
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize(
    ("name", "site"),
    [
        ("void gated_resnorm_kernel<__nv_bfloat16, 12>(Params<__nv_bfloat16>)", "fused"),
        (
            "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>",
            "norm",
        ),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
            "elementwise",
        ),
        (
            "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl<MulFunctor<float>>>",
            "elementwise",
        ),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "other"),
        ("aten::native_layer_norm", "norm"),
        ("aten::_fused_rms_norm", "norm"),
        ("aten::add", "elementwise"),
        ("aten::mm", "other"),
    ],
)
def test_profiler_names_map_to_sites(name: str, site: str) -> None:
    assert kernel_class(name, SITES) == site


def test_default_config_follows_free_memory() -> None:
    tokens = 4096 + 512
    assert denoise.default_config(None, tokens) == "tiny"
    assert denoise.default_config(140 * 10**9, tokens) == "dev"  # an H200
    assert denoise.default_config(40 * 10**9, tokens) == "klein-4b"
    assert 70e9 < denoise.bytes_needed(Flux2Config.preset("dev"), torch.bfloat16, tokens) < 80e9


@no_cuda
@pytest.mark.parametrize(
    "command",
    [
        ["kernel"],
        ["kernel", "--shapes", "6144x4608"],
        ["step"],
        ["step", "--configs", "dev"],
        ["step", "--config", "dev", "--text-tokens", "77"],
        ["pipeline", "--config", "dev", "--txt-tokens", "77"],
        ["step", "--host", "diffusers", "--lora", "4", "--offload", "group"],
        ["pipeline"],
    ],
)
def test_gpu_commands_refuse_without_cuda(command: list[str]) -> None:
    code, out, err = run_cli(command)
    assert code == 2 and out == ""
    assert err.startswith("flux2-fused: error: ") and "needs a CUDA GPU" in err and len(err.splitlines()) == 1


def test_kernel_help_passes_through() -> None:
    code, out, _err = run_cli(["kernel", "--help"])
    assert code == 0 and "--shapes" in out
    assert out.startswith("usage: flux2-fused kernel ")
    assert re.search(r"--batch B\s+batch size", out) and re.search(
        r"--dtype \{bf16,fp16\}\s+element type", out
    )


@pytest.mark.parametrize("command", ["bench", "step", "pipeline", "kernel", "verify", "build"])
def test_every_option_has_help(command: str) -> None:
    parser = build_parser()[1][command]
    assert parser.prog == f"flux2-fused {command}"
    assert all(action.help for action in parser._actions), [a.dest for a in parser._actions if not a.help]


def test_step_help() -> None:
    code, out, _err = run_cli(["step", "--help"])
    assert code == 0 and out.startswith("usage: flux2-fused step") and "--compile" in out


def _help(args: list[str]) -> str:
    """A --help text with argparse's line wrapping undone."""
    code, out, _err = run_cli([*args, "--help"])
    assert code == 0
    return " ".join(out.split())


def test_help_speaks_of_the_product_as_it_is() -> None:
    """Every family, every op, every pipeline the pipeline benchmark calls."""
    assert (
        "Bit-exact fused CUDA kernels for diffusion transformers (FLUX.3, FLUX.2, FLUX.1, Qwen-Image, "
        "Z-Image)" in _help([])
    )
    verify = _help(["verify"])
    assert all(op in verify for op in options.KERNEL_OPS) and "the fused kernel " not in verify
    assert "where each op's module came from" in verify and "without a GPU" in verify
    pipeline = _help(["pipeline"])
    pipelines = (
        "Flux2KleinPipeline",
        "Flux2Pipeline (dev)",
        "FluxPipeline",
        "Flux3ModularPipeline (flux3-klein",
    )
    assert all(name in pipeline for name in (*pipelines, "Flux3DistilledModularPipeline (flux3-klein-flow)"))


@pytest.mark.parametrize("command", ["bench", "step", "pipeline"])
@pytest.mark.parametrize("config", options.CONFIG_OPTION)
@pytest.mark.parametrize("tokens", options.TEXT_TOKENS_OPTION)
def test_every_benchmark_takes_both_spellings(command: str, config: str, tokens: str) -> None:
    """`--config` and `--text-tokens` on every benchmark, `--configs` and `--txt-tokens` (the spelling
    step and pipeline had) too, each setting what the command reads."""
    args = build_parser()[1][command].parse_args([config, "klein-4b", tokens, "77"])
    if command == "bench":
        assert (args.config, args.text_tokens) == ("klein-4b", 77)
    else:
        assert (args.configs, args.txt_tokens) == (["klein-4b"], 77)
    assert f"{config} NAME" in _help([command])


def _fresh_version_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The integration looks the diffusers version up once a process: this test's own lookup."""
    from flux2_fused.integrations import diffusers as integration

    monkeypatch.setattr(integration, "check_version", functools.cache(integration.check_version.__wrapped__))


def _without(package: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `package` look uninstalled to the checks (its distribution and its import spec)."""
    _fresh_version_check(monkeypatch)
    version, find_spec = importlib.metadata.version, importlib.util.find_spec

    def missing_version(name: str) -> str:
        if name == package:
            raise importlib.metadata.PackageNotFoundError(name)
        return version(name)

    monkeypatch.setattr(importlib.metadata, "version", missing_version)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == package else find_spec(name, *a)
    )


def _diffusers_version(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _fresh_version_check(monkeypatch)
    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: version if name == "diffusers" else real(name)
    )


@pytest.mark.parametrize(
    ("args", "environment", "message"),
    [
        (["step", "--lora", "4"], None, "--lora, --offload and --quantize apply to --host diffusers"),
        (
            ["step", "--configs", "klein-4b", "flux1-dev"],
            None,
            "flux1-dev: FLUX.1 has no model of the package's own; run it with --host diffusers",
        ),
        (
            ["step", "--config", "flux3-klein", "flux1-dev"],
            None,
            "flux3-klein, flux1-dev: FLUX.1 and FLUX.3 have no model of the package's own; run it with "
            "--host diffusers",
        ),
        (
            ["step", "--host", "diffusers", "--config", "flux3-klein", "--reference-tokens", "-1"],
            None,
            "--reference-tokens must be at least 0, got -1",
        ),
        (
            [
                "step",
                "--host",
                "diffusers",
                "--config",
                "flux3-klein",
                "klein-4b",
                "--reference-tokens",
                "64",
            ],
            None,
            "--reference-tokens: reference images are FLUX.3's, not klein-4b's",
        ),
        (["step", "--offload", "model"], None, "--lora, --offload and --quantize apply to --host diffusers"),
        (["step", "--quantize", "int8"], None, "--lora, --offload and --quantize apply to --host diffusers"),
        (["step", "--host", "diffusers", "--lora", "0"], None, "--lora must be at least 1, got 0"),
        (
            ["step", "--host", "diffusers", "--compile", "--lora", "4"],
            None,
            "--compile and --vs-compile on --host diffusers take --quantize, not --lora or --offload",
        ),
        (
            ["step", "--host", "diffusers", "--vs-compile", "--offload", "group"],
            None,
            "--compile and --vs-compile on --host diffusers take --quantize, not --lora or --offload",
        ),
        (
            ["step", "--compile", "--vs-compile"],
            None,
            "--compile compiles both modes; --vs-compile, --graph and --floor",
        ),
        (
            ["step", "--compile", "--graph"],
            None,
            "--compile compiles both modes; --vs-compile, --graph and --floor add modes to eager and fused",
        ),
        (
            ["step", "--compile", "--floor"],
            None,
            "--compile compiles both modes; --vs-compile, --graph and --floor add modes to eager and fused",
        ),
        (
            ["step", "--host", "diffusers", "--floor", "--quantize", "int8"],
            None,
            "--floor takes plain or float8 linears: not --quantize int8",
        ),
        (
            ["step", "--host", "diffusers", "--graph", "--offload", "model"],
            None,
            "--graph and --floor capture a step on the GPU: without --offload",
        ),
        (
            ["step", "--host", "diffusers", "--floor", "--offload", "group"],
            None,
            "--graph and --floor capture a step on the GPU: without --offload",
        ),
        (["step", "--vs-compile", "fused"], None, "argument --vs-compile: invalid choice: 'fused'"),
        (["step", "--batch", "1", "0"], None, "--batch must be at least 1, got 0"),
        (["step", "--plot", "scan.svg"], None, "--plot scan.svg: the file name must end in .png"),
        (["step", "--steps", "0"], None, "--steps must be at least 1, got 0"),
        (["step", "--block", "0"], None, "--block must be at least 1, got 0"),
        (["step", "--lead-in", "-1"], None, "--lead-in must be at least 0, got -1"),
        (["step", "--host", "diffusers"], "no diffusers", "--host diffusers: diffusers is not installed"),
        (
            ["step", "--host", "diffusers"],
            "diffusers 0.50",
            "diffusers 0.50.0 is outside the supported range",
        ),
        (
            ["step", "--host", "diffusers", "--lora", "8"],
            "no peft",
            "--lora needs peft, which is not installed",
        ),
        (
            ["step", "--host", "diffusers", "--offload", "model"],
            "no accelerate",
            "--offload model needs accelerate",
        ),
        (["step", "--host", "diffusers", "--quantize", "int8"], "no torchao", "--quantize needs torchao"),
        (["pipeline", "--height", "1000"], None, "--height 1000 is not a positive multiple of 16"),
        (["pipeline", "--pairs", "0"], None, "--pairs must be at least 1, got 0"),
        (["pipeline", "--txt-tokens", "0"], None, "--text-tokens must be at least 1, got 0"),
        (["pipeline"], "no diffusers", "the pipeline benchmark: diffusers is not installed"),
        (
            ["pipeline", "--config", "klein-4b", "flux3-klein-flow"],
            "no transformers",
            "flux3-klein-flow: diffusers' FLUX.3 pipeline needs transformers, which is not installed",
        ),
        (
            ["pipeline", "--config", "flux3-klein", "--cache", "none", "magcache"],
            None,
            "--cache magcache: cache-dit and diffusers' caches do not run on FLUX.3",
        ),
        (["step", "--batch", "0"], None, "--batch must be at least 1, got 0"),
        (["step", "--img-tokens", "0"], None, "--img-tokens must be at least 1, got 0"),
        (["step", "--txt-tokens", "-5"], None, "--text-tokens must be at least 1, got -5"),
        (["step", "--json", "/no-such-folder/s.json"], None, "folder /no-such-folder does not exist"),
        (["pipeline", "--json", "/no-such-folder/p.json"], None, "folder /no-such-folder does not exist"),
        (
            ["kernel", "--shapes", "6144x"],
            None,
            "--shapes '6144x': --op gated_resnorm takes DxT, DxT:token, DxT:update2, DxT:twin, DxT:quant, "
            "DxT:update2-quant, DxT:twin-quant, DxT:update2-proven or DxT:twin-proven (hidden x tokens, e.g. "
            "6144x4608; quant: torchao's per-row float8 of the norm; proven: modulation rows proven equal), "
            "whole numbers of at least 1",
        ),
        (["kernel", "--shapes", "6144x4608", "0x512"], None, "--shapes '0x512': --op gated_resnorm takes"),
        (["kernel", "--shapes", "6144x4608:single"], None, "--shapes '6144x4608:single': --op gated_resnorm"),
        (
            ["kernel", "--op", "qk_norm_rope", "--shapes", "24x4608:double"],
            None,
            "--op qk_norm_rope takes HxT, HxT:single, HxT:upcast or HxT:qwen",
        ),
        (
            ["kernel", "--op", "qk_norm_rope", "--shapes", "24x4608:twin"],
            None,
            "--shapes '24x4608:twin': --op qk_norm_rope takes HxT, HxT:single, HxT:upcast or HxT:qwen",
        ),
        (["kernel", "--op", "swiglu", "--shapes", "big"], None, "--shapes 'big': --op swiglu takes HxT"),
        (["kernel", "--batch", "0"], None, "--batch must be at least 1, got 0"),
        (["kernel", "--json", "/no-such-folder/k.json"], None, "folder /no-such-folder does not exist"),
        (["build", "--arch", "9.0", "7.5"], None, "7.5 is older than the kernels' minimum"),
        (["bench", "--parallel", "ring=2", "--config", "dev"], None, "--parallel ring=2 needs 2 CUDA GPUs"),
    ],
    ids=[
        "lora-without-diffusers-host",
        "flux1-on-the-package-host",
        "flux3-and-flux1-on-the-package-host",
        "negative-reference-tokens",
        "reference-tokens-without-flux3",
        "offload-without-diffusers-host",
        "quantize-without-diffusers-host",
        "lora-rank",
        "compile-diffusers-lora",
        "vs-compile-diffusers-offload",
        "compile-and-vs-compile",
        "compile-and-graph",
        "compile-and-floor",
        "floor-quantize",
        "graph-offload",
        "floor-offload",
        "vs-compile-choice",
        "step-batches",
        "step-plot-format",
        "steps",
        "block",
        "lead-in",
        "no-diffusers",
        "diffusers-too-new",
        "no-peft",
        "no-accelerate",
        "no-torchao",
        "pipeline-height",
        "pipeline-pairs",
        "pipeline-txt-tokens",
        "pipeline-no-diffusers",
        "pipeline-flux3-no-transformers",
        "pipeline-flux3-cache",
        "step-batch",
        "step-img-tokens",
        "step-txt-tokens",
        "step-json",
        "pipeline-json",
        "kernel-shape",
        "kernel-zero",
        "kernel-layout",
        "kernel-qk-layout",
        "kernel-qk-gated-resnorm-layout",
        "kernel-swiglu-shape",
        "kernel-batch",
        "kernel-json",
        "build-arch",
        "parallel-before-cpu-estimate",
    ],
)
def test_arguments_are_checked_before_the_machine(
    args: list[str], environment: str | None, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Options that cannot go together, values the run cannot use, unwritable outputs, or options this
    environment cannot run, are one line and exit 2 on any machine, before the CUDA check and before
    any model is built (`bench --parallel` on the CPU: before the CPU's memory and time estimate,
    which is no concern of a multi-GPU run)."""
    if environment == "diffusers 0.50":
        _diffusers_version("0.50.0", monkeypatch)
    elif environment is not None:
        _without(environment.removeprefix("no "), monkeypatch)
    code, out, err = run_cli(args)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("flux2-fused: error: ") and message in err, err


@pytest.mark.parametrize(
    ("module", "other"),
    [
        ("flux2_fused.bench.denoise", "flux2_fused.bench.plot"),
        ("flux2_fused.bench.plot", "flux2_fused.bench.denoise"),
    ],
)
def test_denoise_and_plot_do_not_import_each_other(module: str, other: str) -> None:
    code = f"import sys, {module}; sys.exit({other!r} in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env=SUBPROCESS_ENV, timeout=120).returncode == 0


@pytest.fixture(scope="module")
def built_sm90() -> tuple[int, str, str]:
    """`build --arch 9.0` once (15-30 s on a cold cache); skipped where nvcc or apache-tvm-ffi is missing."""
    if jit.find_nvcc() is None:
        pytest.skip("needs nvcc (CUDA toolkit)")
    pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (pip install apache-tvm-ffi)")
    return run_cli(["build", "--arch", "9.0"])


def test_build_without_gpu(built_sm90: tuple[int, str, str]) -> None:
    code, out, err = built_sm90
    assert code == 0, err
    built = dict(line.split(": ", 1) for line in out.strip().splitlines())
    assert list(built) == [f"9.0 {op.name}" for op in OPS]
    for op in OPS:
        assert built[f"9.0 {op.name}"].endswith(".so") and Path(built[f"9.0 {op.name}"]).is_file()
        done = re.search(
            rf"^flux2-fused: {op.name} for sm 9\.0: (cached|built in \d+\.\d s)$", err, re.MULTILINE
        )
        assert done, err
        # "building" is said before a compile and only then
        assert (f"building the {op.name} kernel for sm 9.0" in err) == (done.group(1) != "cached")


@pytest.mark.parametrize("text", ["7.0", "7.5", "sm_75", "61"])
def test_build_refuses_architectures_older_than_sm80(text: str) -> None:
    code, out, err = run_cli(["build", "--arch", text])
    assert code == 2 and out == "" and "is older than the kernels' minimum 8.0 (sm_80)" in err


@pytest.mark.parametrize(
    "args",
    [
        ["--arch", "8.0", "9.0a", "10.0", "12.0"],
        ["--arch", "8.0", "9.0a", "--arch", "10.0", "--arch", "sm_120"],
    ],
    ids=["one-option", "repeated"],
)
def test_build_takes_several_architectures(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, args: list[str]
) -> None:
    """sm 8.0 is in the cache, the others are built now: the messages say which, and "building"
    is announced only for a real build."""
    built: list[str] = []
    monkeypatch.setattr(jit, "is_cached", lambda spec, archs: archs == ["8.0"])

    def fake_build(spec: jit.KernelSpec, archs: list[str]) -> Path:
        built.append(archs[0])
        return tmp_path / f"{spec.name}-{archs[0]}.so"

    monkeypatch.setattr(jit, "build", fake_build)
    code, out, err = run_cli(["build", *args])
    assert code == 0, err
    archs = ("8.0", "9.0a", "10.0", "12.0")
    assert [line.split(": ")[0] for line in out.splitlines()] == [
        f"{a} {op.name}" for a in archs for op in OPS
    ]
    assert built == [arch for arch in archs for _ in OPS]
    assert (
        "gated_resnorm for sm 8.0: cached" in err
        and "building the gated_resnorm kernel for sm 8.0" not in err
    )
    assert re.search(r"gated_resnorm for sm 12\.0: built in \d+\.\d s", err)
    assert "building the gated_resnorm kernel for sm 12.0" in err


def test_build_error_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jit, "find_nvcc", lambda: None)
    code, out, err = run_cli(["build", "--arch", "sm_90"])
    assert code == 1 and out == ""
    assert err.strip().splitlines()[-1].startswith("flux2-fused: error: nvcc not found")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--parallel", "ulysses"], "expected degrees like ulysses=2"),
        (["--parallel", "pipeline=2"], "expected degrees like ulysses=2"),
        (["--parallel", "ulysses=1"], "multiply to 1"),
        (["--parallel", "tp=2,ulysses=2"], "tensor and context parallelism together"),
        (["--parallel", "ulysses=2", "--weights", "w"], "does not take --weights"),
        (["--parallel", "ulysses=2", "--height", "100"], "not a positive multiple of 16"),
        (["--parallel", "ring=2"], "needs 2 CUDA GPUs"),
    ],
)
def test_bench_parallel_refuses_in_one_line_before_any_work(args: list[str], message: str) -> None:
    code, out, err = run_cli(["bench", *args])
    assert code == 2 and out == ""
    assert err.startswith("flux2-fused: error: ") and message in err and len(err.splitlines()) == 1


def test_build_bundle_refuses_a_file_or_a_missing_parent_in_one_line(tmp_path: Path) -> None:
    """`build --bundle DIR` checks its folder before compiling anything."""
    target = tmp_path / "file"
    target.write_text("")
    for folder, message in (
        (target, f"--bundle {target} is a file; give a folder"),
        (
            tmp_path / "no" / "such",
            f"--bundle {tmp_path / 'no' / 'such'}: folder {tmp_path / 'no'} does not exist",
        ),
    ):
        assert run_cli(["build", "--bundle", str(folder)]) == (2, "", f"flux2-fused: error: {message}\n")


@pytest.mark.parametrize("host", ["package", "diffusers"])
@pytest.mark.parametrize(
    ("make_folder", "message"),
    [
        (lambda tmp: tmp / "missing", "does not exist"),
        (lambda tmp: _pipeline_folder(tmp), "is a pipeline folder; pass "),
        (lambda tmp: _vae_folder(tmp), "config.json describes AutoencoderKLFlux2, not a FLUX.2 transformer"),
    ],
    ids=["missing", "pipeline-folder", "vae-folder"],
)
def test_step_weights_are_checked_before_the_machine(
    tmp_path: Path, make_folder, message: str, host: str
) -> None:
    """`step --weights` checks the folder as `bench --weights` does, on any machine, in one line."""
    status, _out, err = run_cli(["step", "--host", host, "--weights", str(make_folder(tmp_path))])
    assert status == 2 and err.startswith("flux2-fused: error: ") and message in err
    assert err.count("\n") == 1
