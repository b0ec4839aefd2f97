"""`flux2-fused bench --plot FILE.png`: step times and per-site kernel time, eager vs fused.

matplotlib is an optional dependency (`pip install 'flux2-fused[plot]'`), imported only when a plot
is asked for, and drawn through a bare `Figure` on the Agg canvas: no pyplot, no display, no global
backend switch that could disturb a host program.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import CommandError
from .report import MODES, SITES, BenchReport, speedup_text

COLORS = {"eager": "tab:gray", "fused": "tab:blue"}


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
