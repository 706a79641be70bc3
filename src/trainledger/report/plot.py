"""A picture of a ledger: live bytes stacked by category over the step's event clock.

matplotlib is optional (``pip install 'trainledger[plot]'``) and imported only when a plot is drawn. The
figure is drawn on its own Agg canvas, without pyplot, so a plot never changes the caller's matplotlib
backend or leaves figures open.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainledger.errors import InputError
from trainledger.ledger import CATEGORY_ORDER, Ledger
from trainledger.report._files import PLOT_SUFFIXES, check_output_path, peak_label

if TYPE_CHECKING:
    from trainledger.remat import ParetoResult, Point

# A fixed colour per category (the same in every picture), in the fixed category order.
CATEGORY_COLORS: dict[str, str] = {
    "weights": "#4e79a7",
    "frozen": "#9c755f",
    "gradients": "#f28e2b",
    "optimizer": "#e15759",
    "activations": "#59a14f",
    "workspace": "#edc948",
    "inputs": "#b07aa1",
    "communication": "#76b7b2",
    "other": "#bab0ac",
}
PHASE_COLORS: dict[str, str] = {
    "forward": "#dbe9f6",
    "backward": "#fde2cf",
    "optimizer": "#e3f1df",
    "zero_grad": "#ececec",
    "state": "#f4f4f4",
}
_OTHER_PHASE_COLOR = "#f0e6f6"

# 1024-based units, chosen by the scale of the largest value drawn.
_BINARY_UNITS = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))


def _unit(max_bytes: int) -> tuple[int, str]:
    for scale, name in _BINARY_UNITS:
        if max_bytes >= scale:
            return scale, name
    return 1, "B"


def phase_runs(ledger: Ledger) -> list[tuple[str, int, int]]:
    """Contiguous runs of one phase on the clock: ``(phase, first event, last event + 1)``.

    Example:
        >>> from trainledger.ledger import Event, Ledger
        >>> phases = ["forward", "forward", "backward", "optimizer", "optimizer"]
        >>> phase_runs(Ledger((), tuple(Event(i, p) for i, p in enumerate(phases))))
        [('forward', 0, 2), ('backward', 2, 3), ('optimizer', 3, 5)]
    """
    runs: list[tuple[str, int, int]] = []
    for i, ev in enumerate(ledger.events):
        if runs and runs[-1][0] == ev.phase:
            runs[-1] = (ev.phase, runs[-1][1], i + 1)
        else:
            runs.append((ev.phase, i, i + 1))
    return runs


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise InputError(
            "plots need matplotlib, which is not installed; install it with: pip install 'trainledger[plot]'"
        ) from exc
    return Figure, FigureCanvasAgg


def plot_timeline(
    ledger: Ledger,
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    protect: Iterable[str | os.PathLike[str]] = (),
) -> Path:
    """Draw live bytes stacked by category over the event clock, and write it as PNG or SVG.

    The picture shows the phases (forward, backward, optimizer, zero_grad) as shaded bands, the peak
    (the largest simultaneous total) with the op, module and phase where it happens, and a faint line at
    the sum of per-category maxima, which is *not* a simultaneous total.

    Arguments:
        ledger: any ledger; a traced one has one event per op.
        path: the output file; ``.png`` or ``.svg`` (the format follows the suffix).
        title: the figure's title (default: the model's name, if the ledger's meta has one, and the evidence).
        protect: the user's input files; writing over one is refused.

    Returns:
        The path written.

    Example:
        >>> from trainledger.examples import mlp
        >>> from trainledger.trace import trace
        >>> plot_timeline(trace(mlp()), "step.png")  # doctest: +SKIP
        PosixPath('step.png')
    """
    out = check_output_path(path, PLOT_SUFFIXES, what="plot", protect=protect)
    fig = timeline_figure(ledger, title=title)
    fig.savefig(out, format=out.suffix.lower().lstrip("."))
    return out


def timeline_figure(ledger: Ledger, *, title: str | None = None) -> Any:
    """The :func:`plot_timeline` picture as a ``matplotlib.figure.Figure`` (to show in a notebook, or adjust).

    Example:
        >>> from trainledger.ledger import Category, Entry, Event, Ledger
        >>> w = Entry("w", Category.WEIGHTS, "param", "float32", 256, 1024)
        >>> fig = timeline_figure(Ledger((w,), (Event(0, "forward", "mm"), Event(1, "backward", "mm"))))
        >>> fig.axes[0].get_ylabel()
        'live memory (KiB, 1 KiB = 2^10 bytes)'
    """
    Figure, FigureCanvasAgg = _matplotlib()

    n = ledger.num_events
    timeline = ledger.timeline()
    cats = [c.value for c in CATEGORY_ORDER if any(timeline[c.value])]
    peak = ledger.peak()
    sum_max = ledger.sum_of_category_maxima()
    scale, unit = _unit(max(peak.bytes, sum_max, 1))

    fig = Figure(figsize=(12, 6), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    top = max(peak.bytes, sum_max) / scale
    ax.set_xlim(0, n)
    ax.set_ylim(0, top * 1.18 if top else 1)
    _draw_phases(ax, ledger)
    if cats:
        # Each event occupies [i, i + 1) on the x axis: a step function, drawn with one extra point at the end.
        ys = [[v / scale for v in timeline[c]] + [timeline[c][-1] / scale] for c in cats]
        ax.stackplot(
            list(range(n + 1)),
            *ys,
            labels=cats,
            colors=[CATEGORY_COLORS[c] for c in cats],
            step="post",
            lw=0,
            zorder=2,
        )
    if sum_max > peak.bytes:
        ax.axhline(
            sum_max / scale,
            color="#777777",
            lw=1,
            ls=(0, (4, 3)),
            zorder=3,
            label="sum of category maxima\n(not simultaneous)",
        )
    _draw_peak(ax, ledger, scale, unit)
    _label_axes(ax, ledger, unit, title)
    fig.tight_layout()
    return fig


def _draw_phases(ax: Any, ledger: Ledger) -> None:
    """A band of colour behind each phase, named where it is wide enough to hold the name."""
    n = ledger.num_events
    for phase, first, stop in phase_runs(ledger):
        ax.axvspan(first, stop, color=PHASE_COLORS.get(phase, _OTHER_PHASE_COLOR), zorder=0, lw=0)
        if (stop - first) / n >= 0.04:
            ax.text(
                (first + stop) / 2,
                0.985,
                phase,
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="top",
                fontsize=9,
                color="#555555",
            )


def _draw_peak(ax: Any, ledger: Ledger, scale: int, unit: str) -> None:
    """The peak instant: a dotted line, a marker, and its label on the side with room."""
    peak = ledger.peak()
    px, py = peak.event + 0.5, peak.bytes / scale
    ax.axvline(px, color="#222222", lw=0.8, ls=":", zorder=3)
    ax.plot([px], [py], marker="v", color="#222222", ms=7, zorder=4, ls="none")
    right_half = px > ledger.num_events / 2
    ax.annotate(
        peak_label(ledger, _fmt(peak.bytes, scale, unit)),
        xy=(px, py),
        xytext=(-12 if right_half else 12, 14),
        textcoords="offset points",
        ha="right" if right_half else "left",
        va="bottom",
        fontsize=10,
        bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "#999999", "alpha": 0.9},
        arrowprops={"arrowstyle": "-", "color": "#222222", "lw": 0.8},
        zorder=5,
    )


def _label_axes(ax: Any, ledger: Ledger, unit: str, title: str | None) -> None:
    """Axis labels with the unit defined, a light grid, the title and the legend."""
    if ledger.num_events > 1:
        ax.set_xlabel("event (one per op on the step's clock)")
    else:  # one instant: an x axis would only show meaningless fractions
        ax.set_xticks([])
    ax.set_ylabel(f"live memory ({unit}, 1 {unit} = {_unit_def(unit)})")
    ax.grid(axis="y", color="#cccccc", lw=0.5, zorder=1)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(title if title is not None else _default_title(ledger), loc="left", fontsize=12)
    if ax.get_legend_handles_labels()[0]:  # an empty ledger has nothing to name
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)


def _fmt(nbytes: int, scale: int, unit: str) -> str:
    return f"{nbytes} B" if scale == 1 else f"{nbytes / scale:.2f} {unit}"


def _unit_def(unit: str) -> str:
    power = {"B": 0, "KiB": 10, "MiB": 20, "GiB": 30, "TiB": 40}[unit]
    return "1 byte" if power == 0 else f"2^{power} bytes"


def _default_title(ledger: Ledger) -> str:
    model = ledger.meta.get("model")
    head = f"{model}: " if model else ""
    if ledger.num_events == 1:
        return f"{head}training state (evidence: {ledger.evidence}, {ledger.device})"
    return f"{head}live memory over one training step (evidence: {ledger.evidence}, {ledger.device})"


# --- activation checkpointing's trade-off curve (trainledger pareto) ------------------------------------


def plot_pareto(
    result: ParetoResult, path: str | os.PathLike[str], *, protect: Iterable[str | os.PathLike[str]] = ()
) -> Path:
    """``trainledger pareto --plot``: peak (MiB) against extra compute for every method, with the plain peak
    (dashed) and the floor (dotted); returns the path written."""
    out = check_output_path(path, PLOT_SUFFIXES, what="plot", protect=protect)
    Figure, Canvas = _matplotlib()
    fig = Figure(figsize=(7.5, 4.8), layout="constrained")
    Canvas(fig)
    ax = fig.add_subplot()
    mib = 2**20
    seconds = result.cost == "seconds"

    def x(p: Point) -> float:
        return p.extra_seconds * 1e3 if seconds else (p.extra_flops + p.extra_other_flops) / 1e9

    series = {
        "ours (DP / MILP)": [r.ours for r in result.rows if r.ours],
        "MILP optimum": [r.milp for r in result.rows if r.milp],
        "greedy knapsack": [r.greedy for r in result.rows if r.greedy],
    }
    styles = {"ours (DP / MILP)": "o-", "MILP optimum": "x", "greedy knapsack": "s--"}
    for label, pts in series.items():
        pts = sorted(pts, key=x)
        ax.plot([x(p) for p in pts], [p.peak_bytes / mib for p in pts], styles[label], label=label, alpha=0.85)
    reserved = sorted((r.ours for r in result.rows if r.ours and r.ours.reserved_peak_bytes is not None), key=x)
    if reserved:
        label = "ours: predicted reserved (allocator model)"
        ax.plot([x(p) for p in reserved], [(p.reserved_peak_bytes or 0) / mib for p in reserved], "o:", label=label)
    for p, marker in ((result.uniform, "D"), (result.sqrt_n, "^")):
        label = "uniform per-block" if p.method == "uniform" else "Chen √n"
        ax.plot([x(p)], [p.peak_bytes / mib], marker, markersize=9, label=label)
    for b, marker in zip(result.baselines, "PXh*", strict=False):
        if b.peak_bytes is not None and b.name != "full":  # (full per block is the uniform point above)
            bx = (b.extra_seconds or 0.0) * 1e3 if seconds else b.cost_flops / 1e9
            ax.plot([bx], [b.peak_bytes / mib], marker, markersize=9, label=b.label)
    sac = result.extra.get("torch_sac_ilp", {}).get("points")
    if sac:
        ax.plot(
            [p["extra_seconds"] * 1e3 if seconds else 0 for p in sac],
            [p["peak_bytes"] / mib for p in sac],
            "v:",
            label="PyTorch SAC MILP (budget less optimizer state; its modules recomputed whole)",
        )
    ax.axhline(result.plain_peak_bytes / mib, color="grey", lw=0.8, ls="--")
    ax.axhline(result.floor_bytes / mib, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("extra compute in backward (" + ("ms, measured" if seconds else "GFLOP") + ")")
    ax.set_ylabel("predicted peak (MiB = 2^20 bytes)")
    on = "predicted reserved bytes" if result.budget_on == "reserved" else "allocated bytes"
    ax.set_title(
        f"{result.model}: peak vs recomputation, budgets on {on} (dashed: plain peak, dotted: floor)", fontsize=10
    )
    ax.legend(fontsize=8)
    fig.savefig(out, format=out.suffix.lower().lstrip("."))
    return out
