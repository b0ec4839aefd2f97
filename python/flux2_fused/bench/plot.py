"""`flux2-fused bench --plot FILE.png`: step times and per-site kernel time, eager vs fused; and
`flux2-fused step --plot FILE.png`: the pipelined step time against image size, a panel a config.

matplotlib is an optional dependency (`pip install 'flux2-fused[plot]'`), imported only when a plot
is asked for, and drawn through a bare `Figure` on the Agg canvas: no pyplot, no display, no global
backend switch that could disturb a host program.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Sequence
from pathlib import Path

from ..errors import CommandError
from .results.bench import BenchReport
from .results.step import StepResult
from .results.tables import MODES, SITES, speedup_text

COLORS = {
    "eager": "tab:gray",
    "fused": "tab:blue",
    "compiled": "tab:orange",
    "compiled + fused": "tab:red",
    "GEMM + attention alone": "black",
}
BATCH_STYLES = ("o-", "s--", "^:", "d-.")


def require_matplotlib() -> None:
    """Raise CommandError (before a run, not after it) when the plot could not be drawn."""
    if importlib.util.find_spec("matplotlib") is None:
        raise CommandError(
            "--plot needs matplotlib, which is not installed (pip install 'flux2-fused[plot]')"
        )


def save_plot(report: BenchReport, path: Path) -> None:
    """Two panels: time of every timed step per mode; per-site time of the profiled step per mode."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    steps_ax, sites_ax = fig.subplots(1, 2)
    width = 0.8 / len(MODES)
    for k, mode in enumerate(MODES):
        result = getattr(report, mode)
        label = f"{mode} (median {result.median_ms:.1f} ms)"
        steps_ax.plot(
            range(1, len(result.step_ms) + 1), result.step_ms, "o-", color=COLORS[mode], label=label
        )
        offsets = [i + (k - (len(MODES) - 1) / 2) * width for i in range(len(SITES))]
        sites_ax.bar(offsets, [result.site_ms[s] for s in SITES], width, color=COLORS[mode], label=mode)
    steps_ax.set(xlabel="denoise step", ylabel="ms", title="time per step", ylim=(0, None))
    steps_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    steps_ax.legend()
    kind = "kernel time" if report.gpu else "aten op self time"
    sites_ax.set(xticks=range(len(SITES)), xticklabels=SITES, ylabel="ms", title=f"{kind} by site, one step")
    sites_ax.legend()
    exact = "bit-exact" if report.bit_exact else "NOT bit-exact"
    fig.suptitle(
        f"{report.config} {report.dtype}, {report.height}x{report.width}, batch {report.batch} on "
        f"{report.gpu or 'CPU'}: fused {speedup_text(report.speedup_pct)}, {exact}"
    )
    fig.savefig(path, dpi=110, format="png")  # the format the name was checked to end in


def save_step_plot(results: Sequence[StepResult], path: Path) -> None:
    """A panel a config: the pipelined step time (ms, log scale) of each mode against the image's
    megapixels a sample, a line style a batch size; what the size scan's table holds, at a glance."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    configs = list(dict.fromkeys(r.config for r in results))
    fig = Figure(figsize=(5.5 * len(configs), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(configs), squeeze=False)[0]
    for ax, config in zip(axes, configs, strict=True):
        rows = [r for r in results if r.config == config]
        for batch, style in zip(dict.fromkeys(r.batch for r in rows), itertools.cycle(BATCH_STYLES)):
            line = sorted((r for r in rows if r.batch == batch), key=lambda r: r.img_tokens)
            megapixels = [r.img_tokens * 256 / 1e6 for r in line]
            series = {
                "eager": [r.pipelined.eager_ms for r in line],
                "fused": [r.pipelined.fused_ms for r in line],
            }
            optional = {
                "compiled": [r.compiled_ms for r in line],
                "compiled + fused": [r.compiled_fused_ms for r in line],
                "GEMM + attention alone": [r.floor_ms for r in line],
            }
            series |= {mode: ms for mode, ms in optional.items() if None not in ms}
            for mode, ms in series.items():
                ax.plot(megapixels, ms, style, color=COLORS[mode], label=f"{mode}, batch {batch}")
        ax.set(xlabel="megapixels a sample", ylabel="ms a step (pipelined)", title=config, yscale="log")
        ax.legend(fontsize="small")
    fig.suptitle(f"step time against image size ({results[0].host_label}, bf16)")
    fig.savefig(path, dpi=110, format="png")
