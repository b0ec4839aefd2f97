"""The benchmark commands' options (`flux2-fused bench`, `step`, `pipeline`, `kernel`): their
declarations, the names and defaults they show (spelt alike on every command), the checks of their
values and output paths, and the parser that reports a bad one in one line (the command's and the
`python -m` tools'). No torch here.

Why a module of its own: `flux2-fused --help` and a usage error must answer at once, and importing
torch (which every benchmark module does) takes seconds. So the command line is declared from plain
constants, and the benchmarks import those constants from here rather than the other way round.
Three lists mirror a torch-side table they cannot import without torch (the model presets, the bench
dtypes, the kernel sites and dtypes); test/bench/test_options.py checks that they still match.
"""

from __future__ import annotations

import argparse
import errno
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ..errors import BadValue

# The parser of the command and of the `python -m` tools: one-line usage errors.
PROG = "flux2-fused"
CHOICES = " (choose from "


class Parser(argparse.ArgumentParser):
    """argparse with its usage errors in the command's one-line form and exit status 2.

    argparse prints the whole usage (six lines for `bench`) before its error; the command's promise is
    one line, `flux2-fused: error: ...`, with `--help` a word away. The subcommands' parsers are made
    of this class too (`add_subparsers` uses the parent's class).
    """

    # What its one-line errors begin with: the command's name, or a `python -m` tool's (`tool_parser`).
    error_prog = PROG

    def error(self, message: str) -> NoReturn:
        # Python before 3.12.8 quotes every choice ('dev', 'tiny'); later ones do not: one form here.
        head, found, choices = message.partition(CHOICES)
        message = head + found + choices.replace("'", "")
        self.exit(2, f"{self.error_prog}: error: {message}\n")


def tool_parser(module: str, doc: str) -> Parser:
    """The parser of a `python -m flux2_fused.bench.<module>` tool: one-line errors under its own name,
    its description the first paragraph of its docstring."""
    prog = f"python -m flux2_fused.bench.{module}"
    parser = Parser(prog=prog, description=doc.split("\n\n")[0])
    parser.error_prog = prog
    return parser


# One spelling on every command, the other accepted too: `bench` took `--config` and `--text-tokens`,
# `step` and `pipeline` `--configs` and `--txt-tokens`, so a name learnt on one failed on the other.
CONFIG_OPTION = ("--config", "--configs")
TEXT_TOKENS_OPTION = ("--text-tokens", "--txt-tokens")


def add_text_tokens_argument(parser: argparse.ArgumentParser, dest: str, what: str) -> None:
    """`--text-tokens N` (also `--txt-tokens`), the same spelling and default on every command;
    `dest` keeps each command's attribute name, `what` says what the tokens are there."""
    parser.add_argument(
        *TEXT_TOKENS_OPTION,
        dest=dest,
        type=int,
        default=DEFAULT_TEXT_TOKENS,
        metavar="N",
        help=f"{what} (default {DEFAULT_TEXT_TOKENS})",
    )


def add_configs_argument(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, choices: Sequence[str], default: list[str]
) -> None:
    """`--config NAME [NAME ...]` (also `--configs`) of a benchmark that runs several configs in turn;
    `parser` may be a group (`step` makes it exclusive with `--weights`)."""
    parser.add_argument(
        *CONFIG_OPTION,
        dest="configs",
        nargs="+",
        default=default,
        choices=choices,
        metavar="NAME",
        help=f"one run each, from {', '.join(choices)} (default: {' '.join(default)})",
    )


# --------------------------------------------------------------------------- output files


def folder_problem(folder: Path) -> str | None:
    """Why `folder` cannot hold a new file because it is not there, None when it is a folder: the
    nearest part of it that exists decides between a missing folder and a file in the way."""
    if folder.is_dir():
        return None
    existing = next((part for part in (folder, *folder.parents) if part.exists()), None)
    if existing is not None and not existing.is_dir():
        return f"{existing} is a file, not a folder"
    return f"folder {folder} does not exist"


def _refusal(err: OSError) -> str:
    """Why the system refused to create a file in a folder that exists, in words."""
    if err.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if err.errno == errno.EROFS:
        return "read-only file system"
    if err.errno == errno.ENOENT:  # the folder is there: a file system that takes no new files (/proc, /sys)
        return "its file system takes no new files"
    return err.strerror or str(err)


def check_output(option: str, path: Path | None, suffix: str | None = None) -> None:
    """Raise BadValue before a run, not after minutes of it, when `path` could not be written (or,
    with `suffix`, would be written in another format than its name says)."""
    if path is None:
        return
    if suffix is not None and path.suffix.lower() != suffix:
        raise BadValue(f"{option} {path}: the file name must end in {suffix} (the format written)")
    if path.is_dir():
        raise BadValue(f"{option} {path} is a folder; give a file name")
    folder = path.parent
    problem = folder_problem(folder)
    if problem is not None:
        raise BadValue(f"{option} {path}: {problem}")
    # A probe rather than os.access, which says yes to root on a read-only mount and ignores ACLs. A
    # device or pipe that exists (/dev/stdout) is written as it is, unprobed: opening a pipe can block.
    existing = path.is_file()
    try:
        if existing:  # appending nothing leaves the file as it is
            with path.open("ab"):
                pass
        elif not path.exists():
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".flux2-fused-probe-"):
                pass
    except OSError as err:
        where = f"write {path}" if existing else f"create a file in folder {folder}"
        raise BadValue(f"{option} {path}: cannot {where} ({_refusal(err)})") from err


class OutputFile(argparse.Action):
    """An output file option (`--json`, `--plot`): checked as it is parsed (`check_output`), so every
    command refuses a path it could not write before it looks at the machine or starts any work."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, suffix: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.suffix = suffix

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        path = Path(values)
        try:
            check_output(option_string or self.dest, path, self.suffix)
        except BadValue as err:
            parser.error(str(err))
        setattr(namespace, self.dest, path)


def add_output_arguments(
    parser: argparse.ArgumentParser, json_help: str, plot_help: str | None = None
) -> None:
    """`--json FILE` and, with `plot_help`, `--plot FILE.png`, each checked as it is parsed."""
    parser.add_argument("--json", action=OutputFile, metavar="FILE", help=json_help)
    if plot_help is not None:
        parser.add_argument("--plot", action=OutputFile, suffix=".png", metavar="FILE.png", help=plot_help)


# `flux2-fused bench`
CONFIGS = ("dev", "klein-4b", "klein-9b", "tiny")  # Flux2Config.PRESETS' names
DTYPES = ("bf16", "fp16", "fp32")  # denoise.DTYPES' names
PX_PER_TOKEN = 16  # the VAE downsamples 8x and FLUX.2 packs 2x2 latent pixels into a token
GPU_SIDE, CPU_SIDE = 1024, 256  # default image side in pixels
DEFAULT_STEPS = 4
DEFAULT_TEXT_TOKENS = 512
# `flux2-fused step` (and, FLUX's, `pipeline`); FLUX.1, FLUX.3, Qwen-Image and Z-Image run on
# `--host diffusers` only.
STEP_CONFIGS = (
    "dev",
    "klein-4b",
    "klein-9b",
    "flux1-dev",
    "flux1-schnell",
    "flux3-klein",
    "flux3-klein-flow",
    "qwen-image",
    "z-image-turbo",
)
# The families without a model of the package's own (diffusers' transformer is their one host), by
# the prefix of their config names.
DIFFUSERS_ONLY = {"flux1-": "FLUX.1", "flux3-": "FLUX.3", "qwen-": "Qwen-Image", "z-image-": "Z-Image"}


def diffusers_only(name: str) -> str | None:
    """The family of a config name that has no model of the package's own (FLUX.1, FLUX.3), None for
    a FLUX.2 one."""
    return next((family for prefix, family in DIFFUSERS_ONLY.items() if name.startswith(prefix)), None)


def no_package_model(configs: Sequence[str]) -> str | None:
    """Why these configs cannot run on the package's own model (FLUX.1 and FLUX.3 have none:
    diffusers' transformer is their only host), or None when they all can."""
    names = [name for name in configs if diffusers_only(name)]
    if not names:
        return None
    families = sorted({diffusers_only(name) for name in names})
    verb = "has" if len(families) == 1 else "have"
    return f"{', '.join(names)}: {' and '.join(families)} {verb} no model of the package's own"


# Flux2KleinPipeline, Flux2Pipeline, FluxPipeline, FLUX.3's modular pipelines (base and distilled)
PIPELINE_CONFIGS = (
    "klein-4b",
    "klein-9b",
    "dev",
    "flux1-dev",
    "flux1-schnell",
    "flux3-klein",
    "flux3-klein-flow",
)
PIPELINE_CACHES = ("none", "cache-dit", "magcache")  # what `pipeline --cache` stacks on the transformer
HOSTS = ("package", "diffusers", "comfyui")
OFFLOADS = ("none", "model", "group")
# torchao quantizations of the diffusers host's linears (`bench.hosts.QUANTIZATIONS` builds them).
QUANTIZATIONS = ("none", "float8-row", "float8-tensor", "int8")
# `flux2-fused kernel`
# kernel.CASES' names
KERNEL_OPS = (
    "gated_resnorm",
    "qk_norm_rope",
    "sandwich_norm",
    "swiglu",
    "gelu_tanh",
    "float8_quant",
    "uniform_rows",
)
KERNEL_DTYPES = ("bf16", "fp16")  # kernel.DTYPES' names


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The denoise benchmark's options (the `flux2-fused bench` subcommand's)."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        *CONFIG_OPTION,
        choices=CONFIGS,
        metavar="NAME",
        help=f"preset with random weights, one of {', '.join(CONFIGS)} (default: dev on a GPU with room "
        "for it, klein-4b on a smaller GPU, tiny on the CPU)",
    )
    source.add_argument(
        "--weights", type=Path, metavar="PATH", help="diffusers-format folder (config.json decides the model)"
    )
    sides = f"pixels, a multiple of {PX_PER_TOKEN} (default {GPU_SIDE} on a GPU, {CPU_SIDE} on the CPU)"
    parser.add_argument("--height", type=int, metavar="PX", help=sides)
    parser.add_argument("--width", type=int, metavar="PX", help=sides)
    for option, default, what in (
        ("--steps", DEFAULT_STEPS, "timed denoise steps a mode"),
        ("--batch", 1, "batch size"),
        ("--seed", 0, "seed of the weights, latents and text embeddings"),
    ):
        parser.add_argument(
            option, type=int, default=default, metavar="N", help=f"{what} (default {default})"
        )
    add_text_tokens_argument(parser, "text_tokens", "text tokens a sample")
    parser.add_argument("--dtype", choices=DTYPES, help="default bf16 on a GPU, fp32 on the CPU")
    add_output_arguments(
        parser, "write every figure to FILE", "draw step and kernel times (needs matplotlib)"
    )
    parser.add_argument(
        "--allow-slow",
        action="store_true",
        help="start a CPU run estimated to take over an hour (refused otherwise, with the estimate)",
    )
    parser.add_argument(
        "--parallel",
        metavar="PLAN",
        help="one step under diffusers' parallelism on several GPUs, diffusers alone vs enable(), e.g. "
        "ulysses=2, ring=2, ulysses=2,ring=2 or tp=2 (starts torchrun, or runs inside it; --steps timed "
        "pairs; flux2_fused.bench.parallel)",
    )


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The step benchmark's options (the `flux2-fused step` subcommand's)."""
    model = parser.add_mutually_exclusive_group()
    add_configs_argument(model, STEP_CONFIGS, ["dev", "klein-4b"])
    model.add_argument(
        "--weights",
        type=Path,
        metavar="PATH",
        help="a diffusers-format FLUX.2 transformer folder (its config.json decides the model) instead "
        "of a preset's random weights, as `bench --weights`",
    )
    parser.add_argument(
        "--steps", type=int, metavar="N", help="timed steps per mode (default 7, with --compile 100)"
    )
    parser.add_argument(
        "--batch", type=int, nargs="+", default=[1], metavar="N", help="batch sizes, one run each (default 1)"
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--sizes",
        type=image_size,
        nargs="+",
        metavar="WxH",
        help=f"image sizes in pixels, multiples of {PX_PER_TOKEN}, one run each, e.g. 512x512 1360x768 "
        "(default 1024x1024)",
    )
    size.add_argument("--img-tokens", type=int, metavar="N", help="image tokens instead of a size")
    parser.add_argument(
        "--reference-tokens",
        type=int,
        default=0,
        metavar="N",
        help="FLUX.3: one reference image of N tokens beside the image (image-to-image; default none)",
    )
    add_text_tokens_argument(parser, "txt_tokens", "text tokens")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="both modes under torch.compile(model) (not bit-exact: Inductor fuses the chains itself)",
    )
    parser.add_argument(
        "--vs-compile",
        nargs="?",
        const="eager",
        choices=("eager", "both"),
        help="also torch.compile(model) of the eager forward (and with 'both' of the fused one), "
        "pipelined in turn with eager and fused, its time and output hash beside theirs",
    )
    parser.add_argument(
        "--graph",
        action="store_true",
        help="also the fused step captured in a CUDA graph and replayed, pipelined in turn with eager and "
        "fused: the step without the host's launch work, its bits compared with eager's",
    )
    parser.add_argument(
        "--block",
        type=int,
        default=1,
        metavar="N",
        help="pipelined timing: each mode runs N timed steps in a row, the modes taking turns (default 1)",
    )
    parser.add_argument(
        "--lead-in",
        type=int,
        default=0,
        metavar="N",
        help="pipelined timing: N untimed steps of a mode before each of its blocks (default 0). At the "
        "GPU's power cap a step runs at the clock the seconds of load before it left; a lead-in of a "
        "few seconds times each mode at its own settled clock, as a denoise loop runs one mode",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also the step's GEMM and attention calls alone, replayed from a CUDA graph, pipelined in "
        "turn with eager and fused: the time an exact step can at best reach on this GPU (with --quantize "
        "float8-row or float8-tensor, its scaled GEMMs: the FP8 floor); and the copied step, those calls "
        "with each fused launch replayed as a device copy of the bytes it moves, in its place",
    )
    parser.add_argument(
        "--host",
        choices=HOSTS,
        default="package",
        help="the package's model, or diffusers' Flux2Transformer2DModel with the same weights, eager "
        "being diffusers' own forward and fused enable(model), or ComfyUI's FLUX model (FLUX.2 and "
        "FLUX.1 sizes; its core's folder in FLUX2_FUSED_COMFYUI) with random weights, eager ComfyUI's "
        "own forward (default: package)",
    )
    parser.add_argument(
        "--lora",
        type=int,
        metavar="R",
        help="--host diffusers: a peft LoRA of rank R on the attention and MLP linears",
    )
    parser.add_argument(
        "--offload",
        choices=OFFLOADS,
        default="none",
        help="--host diffusers: weights on the CPU between uses; model: accelerate's hook as "
        "enable_model_cpu_offload, group: block-level group offloading with a side stream (default: none)",
    )
    parser.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        default="none",
        help="--host diffusers: torchao dynamic quantization of every Linear in the blocks: float8 "
        "activations and weights scaled per row or per tensor (sm_89 or newer), or int8 (default: none)",
    )
    add_output_arguments(
        parser, "write the results to FILE", "draw pipelined step time against size (needs matplotlib)"
    )


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    """The pipeline benchmark's options (the `flux2-fused pipeline` subcommand's)."""
    add_configs_argument(parser, PIPELINE_CONFIGS, ["klein-4b"])
    parser.add_argument("--pairs", type=int, default=3, metavar="N", help="timed calls a mode (default 3)")
    parser.add_argument("--steps", type=int, default=8, metavar="N", help="denoise steps a call (default 8)")
    parser.add_argument("--height", type=int, default=1024, metavar="PX", help="default 1024")
    parser.add_argument("--width", type=int, default=1024, metavar="PX", help="default 1024")
    add_text_tokens_argument(parser, "txt_tokens", "prompt embedding tokens")
    parser.add_argument(
        "--guidance-scale",
        type=float,
        default=4.0,
        metavar="S",
        help="Klein and flux3-klein: the CFG scale, above 1 each step runs the prompt and the negative "
        "prompt (FLUX.3: its guider's); dev: the embedded guidance; flux3-klein-flow (distilled) takes "
        "none (default 4.0)",
    )
    parser.add_argument(
        "--cache",
        nargs="+",
        default=["none"],
        choices=PIPELINE_CACHES,
        help="a cache on the transformer, one run each: cache-dit's DBCache (F1B0, steps 0, 1 and every "
        "other step computed) or diffusers' MagCache (every other step skipped); default: none",
    )
    add_output_arguments(parser, "write the results to FILE")


def add_kernel_arguments(parser: argparse.ArgumentParser) -> None:
    """The kernel benchmark's options (the `flux2-fused kernel` subcommand's)."""
    parser.add_argument(
        "--op", choices=KERNEL_OPS, default="gated_resnorm", help="which fused site (default gated_resnorm)"
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        metavar="AxT",
        help="gated_resnorm: DxT items, e.g. 6144x4608, FLUX.3's sites DxT:token (per-token modulation), "
        "DxT:update2 (and a two-term update), DxT:twin (its twin norms, the first 512 tokens text); "
        "qk_norm_rope: HxT (heads x joint tokens) for a double block's prologue, e.g. 24x4608, HxT:single "
        "for a single block's, HxT:upcast for FLUX.3's fp32 one, HxT:qwen for Qwen-Image's; sandwich_norm: "
        "DxT for Z-Image's middle sandwich site, DxT:first, DxT:last; swiglu, gelu_tanh: HxT (hidden x "
        "tokens), swiglu HxT:pair for two projections, HxT:quant and HxT:single (after the attention "
        "output) for its float8, -tensor after either for one scale; float8_quant: KxT (row width x rows), "
        "KxT:tensor "
        "for one scale (default: the op's headline shapes)",
    )
    parser.add_argument(
        "--batch", type=int, default=1, metavar="B", help="batch size B of [B, T, D] (default 1)"
    )
    parser.add_argument("--dtype", choices=KERNEL_DTYPES, default="bf16", help="element type (default bf16)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the chain")
    add_output_arguments(parser, "write the rows to FILE")


def require_at_least_one(counts: Mapping[str, int | None]) -> None:
    """BadValue (exit status 2) naming the first option whose count is below 1; None is an option not
    given, whose default applies. One check, so every benchmark words it alike."""
    for option, value in counts.items():
        if value is not None and value < 1:
            raise BadValue(f"{option} must be at least 1, got {value}")


def image_size(text: str) -> tuple[int, int]:
    """argparse type of `WxH`: (width, height) in pixels, each a positive multiple of PX_PER_TOKEN."""
    width, _, height = text.lower().partition("x")
    if not (width.isdigit() and height.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not WIDTHxHEIGHT in pixels, e.g. 1360x768")
    try:
        check_side(f"{text}:", int(width))
        check_side(f"{text}:", int(height))
    except BadValue as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    return int(width), int(height)


def check_side(option: str, value: int) -> None:
    """BadValue unless `value` pixels make whole latent tokens: FLUX.2 has one a 16x16 pixel patch."""
    if value < PX_PER_TOKEN or value % PX_PER_TOKEN:
        raise BadValue(
            f"{option} {value} is not a positive multiple of {PX_PER_TOKEN} "
            f"(FLUX.2 has one latent token per {PX_PER_TOKEN}x{PX_PER_TOKEN} pixels)"
        )
