"""CPU tests of the benchmarks' layering: the torch-free option lists still match the torch-side tables
they mirror, and no benchmark module imports the command line (`flux2_fused.cli`, `flux2_fused.commands`),
which imports the benchmarks: the dependency runs one way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from flux2_fused.bench import denoise, kernel, options
from flux2_fused.bench.qwenimage import QWEN_IMAGE_PRESETS
from flux2_fused.bench.zimage import Z_IMAGE_PRESETS
from flux2_fused.models.flux1 import FLUX1_PRESETS
from flux2_fused.models.flux2 import Flux2Config
from flux2_fused.models.flux3 import FLUX3_PRESETS

BENCH_DIR = Path(options.__file__).resolve().parent
PACKAGE = "flux2_fused.bench"
COMMAND_LINE = ("flux2_fused.cli", "flux2_fused.commands")


def test_the_option_lists_match_the_tables_they_mirror() -> None:
    assert tuple(Flux2Config.PRESETS) == options.CONFIGS
    assert tuple(denoise.DTYPES) == options.DTYPES
    assert options.KERNEL_OPS == tuple(kernel.CASES) == tuple(kernel.SHAPE_FORMS) == tuple(kernel.LAYOUTS)
    assert tuple(kernel.DTYPES) == options.KERNEL_DTYPES
    flux1_sizes = {name for name in FLUX1_PRESETS if name != "flux1-tiny"}
    flux3_sizes = {name for name in FLUX3_PRESETS if name not in ("flux3-tiny", "flux3-small")}
    qwen_sizes = set(QWEN_IMAGE_PRESETS)
    z_image_sizes = set(Z_IMAGE_PRESETS)
    diffusers_sizes = flux1_sizes | flux3_sizes | qwen_sizes | z_image_sizes
    assert set(options.STEP_CONFIGS) <= set(options.CONFIGS) | diffusers_sizes
    assert set(options.PIPELINE_CONFIGS) <= set(options.STEP_CONFIGS)
    assert diffusers_sizes <= set(options.STEP_CONFIGS)
    assert {options.diffusers_only(name) for name in diffusers_sizes} == {
        "FLUX.1",
        "FLUX.3",
        "Qwen-Image",
        "Z-Image",
    }


@pytest.mark.parametrize("op", options.KERNEL_OPS)
def test_the_default_kernel_shapes_pass_the_shape_check(op: str) -> None:
    """`--shapes` is checked with the parser the run uses: the defaults must pass it too."""
    for item in kernel.DEFAULT_SHAPES[op]:
        size, tokens, layout = kernel.parse_shape(op, item)
        assert size > 0 and tokens > 0 and layout in kernel.LAYOUTS[op]


def imported_modules(path: Path, package: str = PACKAGE) -> set[str]:
    """Every module an `import` or `from ... import` in the file at `path` (a module of `package`)
    names, relative imports resolved, and for `from X import Y` both X and X.Y (Y may be a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def imports_command_line(names: set[str]) -> set[str]:
    return {name for name in names if any(name == m or name.startswith(f"{m}.") for m in COMMAND_LINE)}


def package_of(path: Path) -> str:
    """The package a module of the benchmarks (bench/ or a folder below it) belongs to."""
    return ".".join([PACKAGE, *path.parent.relative_to(BENCH_DIR).parts])


BENCH_MODULES = sorted(BENCH_DIR.rglob("*.py"))


@pytest.mark.parametrize("path", BENCH_MODULES, ids=lambda path: str(path.relative_to(BENCH_DIR)))
def test_no_benchmark_module_imports_the_command_line(path: Path) -> None:
    assert not imports_command_line(imported_modules(path, package_of(path)))


@pytest.mark.parametrize("path", sorted((BENCH_DIR / "results").glob("*.py")), ids=lambda path: path.name)
def test_the_results_import_no_torch_and_no_other_part_of_the_package(path: Path) -> None:
    """What the commands report is plain data and text: printing or plotting a report never imports
    torch or a model."""
    names = imported_modules(path, package_of(path))
    assert not {n for n in names if n == "torch" or n.startswith("torch.")}
    own = {n for n in names if n.startswith("flux2_fused")}
    assert all(n.startswith(f"{PACKAGE}.results") for n in own), own


@pytest.mark.parametrize(
    "source", ["from ..cli import main", "from .. import commands", "import flux2_fused.cli as cli"]
)
def test_every_form_of_import_is_seen(tmp_path: Path, source: str) -> None:
    """The check above resolves relative imports (the benchmarks once ran `from ..cli import main`)."""
    module = tmp_path / "module.py"
    module.write_text(source + "\n", encoding="utf-8")
    assert imports_command_line(imported_modules(module))
