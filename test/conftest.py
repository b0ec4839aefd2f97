"""Shared test configuration: tests marked `gpu` skip cleanly where CUDA is absent; counting which
route a block took (the family's block code, or the host's own call); counting our kernels' launches
and how many a call with every site fused makes."""

import dataclasses
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

from flux2_fused.models.flux2 import blocks
from flux2_fused.ops import FUSED_KERNELS, bits_equal

# Our launches in one transformer call with every site fused, the same for both families: a double
# block's four modulated norms (norm1 and norm2 of each stream), its joint q/k/v prologue and its two
# feed-forwards' activations (SwiGLU in FLUX.2, the tanh GELU in FLUX.1); a single block's norm, its
# prologue and its MLP's activation; one output norm. klein-4B (5 double, 20 single blocks): 96.
DOUBLE_BLOCK_SITES = 4 + 1 + 2
SINGLE_BLOCK_SITES = 1 + 1 + 1
OUTPUT_SITES = 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def count_block_code(monkeypatch: pytest.MonkeyPatch, name: str, family: ModuleType = blocks) -> list[int]:
    """One entry each time a block body (`double_block_body`, `single_block_body`) of a family's
    block code (`family`, default FLUX.2's) runs, from the loop or from a block's fused forward under
    a hook or a cache (both call it through the module)."""
    calls: list[int] = []
    real = getattr(family, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(family, name, counting)
    return calls


def as_kernel_reads(rows: list, scale: Any, shift: Any, words: Any) -> tuple[list, Any, Any]:
    """The segments and modulation as gated_resnorm's kernel reads them with these uniform_rows words
    (`launch`'s (gate, scale and shift) of each segment): where a word is 0, each batch's first row
    for every token (a [B, 1, D] view, which eager broadcasts alike). A proof that was wrong, or
    reached a tensor it should not, then gives other bits than eager."""
    if words is None:
        return rows, scale, shift
    gate0, mod0, gate1, mod1 = words

    def first(t: Any, word: Any) -> Any:
        proven = word is not None and int(word) == 0 and isinstance(t, torch.Tensor) and t.dim() == 3
        return t[:, :1] if proven else t

    rows = [
        dataclasses.replace(segment, gate=first(segment.gate, word))
        for segment, word in zip(rows, (gate0, gate1), strict=False)
    ]
    if type(scale) is tuple:
        mods = (mod0, mod1)[: len(scale)]
        scale = tuple(first(t, word) for t, word in zip(scale, mods, strict=True))
        shift = tuple(first(t, word) for t, word in zip(shift, mods, strict=True))
        return rows, scale, shift
    return rows, first(scale, mod0), first(shift, mod0)


@pytest.fixture
def gated_resnorm_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The gated_resnorm guards accept and its 'kernel' is the reference over the same segments (the
    kernel's contract, modulation read as `as_kernel_reads` says), so the CPU runs the fused branches
    of the block code: pending updates consumed by the next norm, twin norms of two pending streams.
    One entry (the launch's segments) per launch."""
    from flux2_fused.ops import gated_resnorm

    launches: list[int] = []

    def launch(rows, scale, shift, eps, *, write_residual, addcmul=False, words=None):
        launches.append(len(rows))
        rows, scale, shift = as_kernel_reads(rows, scale, shift, words)
        out, stream = gated_resnorm.reference.segments(rows, scale, shift, eps, addcmul=addcmul)
        return out, stream if write_residual else None

    for name in ("gated", "defer", "plain", "gated2", "defer2"):
        monkeypatch.setattr(gated_resnorm.guards, name, lambda *args: True)
    monkeypatch.setattr(gated_resnorm, "launch", launch)
    return launches


@pytest.fixture
def uniform_rows_on_cpu(monkeypatch: pytest.MonkeyPatch, gated_resnorm_on_cpu: list[int]) -> list[int]:
    """`uniform_rows.check` making its proofs on the CPU from the predicate (the kernel's contract),
    with gated_resnorm's stand-in kernel (`gated_resnorm_on_cpu`); one entry a launch: how many of
    its words said equal rows."""
    from flux2_fused.ops import gated_resnorm, uniform_rows

    proven: list[int] = []
    launch = gated_resnorm.launch

    def counted(*args: Any, words: Any = None, **kwargs: Any) -> Any:
        proven.append(sum(1 for word in words or () if word is not None and int(word) == 0))
        return launch(*args, words=words, **kwargs)

    def check(x: torch.Tensor, *, enabled: bool = True) -> Any:
        return uniform_rows.UniformRows(x, uniform_rows.reference.differs(x)) if enabled else None

    monkeypatch.setattr(uniform_rows, "check", check)
    monkeypatch.setattr(gated_resnorm, "launch", counted)
    return proven


@pytest.fixture
def double_blocks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry each time a double block runs the family's block code."""
    return count_block_code(monkeypatch, "double_block_body")


@pytest.fixture
def prologue_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, float, int]]:
    """The qk_norm_rope 'kernel' as its reference over the same segments (its contract), so the CPU
    runs a family's fused prologue (at any head size); one (rotation, norm, eps, segments) entry a
    launch."""
    from flux2_fused.ops import qk_norm_rope

    launches: list[tuple[str, str, float, int]] = []

    def fused(q, k, cos, sin, eps, v=None, *, upcast=False, rotation="aten", norm="fused"):
        launches.append((rotation, norm, eps, len(q)))
        mode = {"upcast": upcast, "rotation": rotation, "norm": norm}
        return qk_norm_rope.reference.prologue(q, k, cos, sin, eps, v, **mode)

    monkeypatch.setattr(qk_norm_rope, "fused", fused)
    return launches


def compiled_targets(
    model: torch.nn.Module, call: Callable[[torch.nn.Module], Any], fullgraph: bool = False
) -> tuple[Any, set]:
    """`call(torch.compile(model))` with a backend that records the traced graphs and runs them as
    traced (eagerly, so the output keeps the model's bits): (the output, the operators the graphs
    call). The compile caches are reset before and after."""
    graphs: list[torch.fx.GraphModule] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch.compiler.reset()
    try:
        out = call(torch.compile(model, fullgraph=fullgraph, backend=recording_backend))
    finally:
        torch.compiler.reset()
    targets = {node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    return out, targets


def fused_sites(double_blocks: int, single_blocks: int) -> int:
    """Our launches in one call of a transformer of these blocks with every site fused."""
    return DOUBLE_BLOCK_SITES * double_blocks + SINGLE_BLOCK_SITES * single_blocks + OUTPUT_SITES


# The block sites' kernels: float8_quant's launches (torchao float8 linears' inputs) are counted apart.
SITE_KERNELS = tuple(k for k in FUSED_KERNELS if k != "float8_quant_kernel")


def fused_launches(fn: Callable[[], object], kernels: tuple[str, ...] = FUSED_KERNELS) -> int:
    """Our kernels' launches in one call of fn (torch.profiler), those of `kernels` (default all)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(any(k in e.name for k in kernels) for e in prof.events() if e.device_type.name == "CUDA")


def images_alone_and_enabled(pipe: Any, run: Callable[[], torch.Tensor]) -> int:
    """`run()` (a pipeline call returning its images) alone and with enable(pipe) gives equal bits;
    returns our kernels' launches in one more enabled call."""
    from flux2_fused.integrations.diffusers import enable

    with torch.inference_mode():
        expected = run()
        handle = enable(pipe)
        try:
            got = run()
            launches = fused_launches(run)
        finally:
            handle.disable()
    assert bits_equal(got, expected)
    return launches
