"""Terminal rendering of ledgers and results with rich. Formats only: computes nothing new."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from trainledger.ledger import CATEGORY_ORDER, Entry, EntryGroup, Ledger, LedgerSummary, Payload, Peak
from trainledger.units import format_bytes, short_dtype

UNITS_NOTE = "GB = 10^9 bytes, GiB = 2^30 bytes"


def both_units(nbytes: int) -> str:
    """``12.00 GB / 11.18 GiB``: decimal and binary, so nobody has to guess which."""
    if nbytes < 1000:
        return f"{nbytes} B"
    return f"{format_bytes(nbytes, binary=False)} / {format_bytes(nbytes)}"


def category_table(
    source: Ledger | Sequence[EntryGroup], *, title: str = "", single_instant: bool | None = None
) -> Table:
    """Rows grouped by category, role and dtype, with element counts, bytes and evidence; totals below.

    ``source`` is a ledger or its ``groups()`` (as saved JSON holds them). The footer of a step with more
    than one instant (``single_instant`` false; for a ledger: more than one event) sums every array
    whenever it lived, and is labelled so: it is not a peak.
    """
    groups = source.groups() if isinstance(source, Ledger) else tuple(source)
    if single_instant is None:
        single_instant = source.num_events <= 1 if isinstance(source, Ledger) else True
    total = sum(g.nbytes for g in groups)
    table = Table(title=title or None, title_justify="left", show_footer=True)
    table.add_column("category", footer="total" if single_instant else "all arrays")
    table.add_column("role")
    table.add_column("dtype")
    table.add_column("arrays", justify="right")
    table.add_column("elements", justify="right")
    table.add_column("bytes", justify="right", footer=f"{total:,}")
    table.add_column("size", justify="right", footer=both_units(total))
    table.add_column("evidence")
    for g in groups:
        table.add_row(
            g.category,
            g.role,
            short_dtype(g.dtype),
            str(g.num_arrays),
            f"{g.numel:,}",
            f"{g.nbytes:,}",
            both_units(g.nbytes),
            ", ".join(g.evidence),
        )
    if not single_instant:
        table.caption = (
            "all arrays: every array of the step summed, whenever it lived; they are never all live at once, "
            "so this is more than the peak (see the peak below)"
        )
    return table


def payload_text(payload: Payload) -> Text:
    """The seed's formula with this ledger's numbers and the running sums."""
    if not payload.rows:
        return Text("payload: no full-length arrays to list")
    terms = " + ".join(_num(r.bytes_per_param) for r in payload.rows)
    lines = [
        f"B_payload = P · Σ b_k = {payload.num_params:,} × ({terms}) = {payload.bytes:,} bytes",
    ]
    for (label, total), row in zip(payload.running_totals(), payload.rows, strict=True):
        lines.append(
            f"  + {label:<22} {_num(row.bytes_per_param):>4} B/param {row.bytes:>16,}   running total {total:,}"
        )
    if payload.outside:
        lines.append(
            "  full-length but not training state of the P parameters, not in the formula: "
            + ", ".join(payload.outside)
        )
    if payload.excluded:
        lines.append("  not full-length arrays, not in the formula: " + ", ".join(payload.excluded))
    return Text("\n".join(lines))


def _num(x: object) -> str:
    f = float(x)  # type: ignore[arg-type]
    return str(int(f)) if f == int(f) else f"{f:.3g}"


def peak_text(
    peak: Peak, *, evidence: str, maxima: dict[str, int], single_instant: bool, kernels: str | None = None
) -> Text:
    """The peak (or, ``single_instant``, the persistent total) and the breakdown at that instant;
    ``kernels``: the kernel kind the figure assumes (``cpu``, ``cuda``), said beside the peak."""
    if single_instant:  # a peak is claimed only from a trace or a measurement
        head = (
            f"total persistent state {peak.bytes:,} bytes ({both_units(peak.bytes)}), evidence {evidence}; "
            "not a peak: activations and workspace come from `trainledger trace`"
        )
    else:
        head = f"peak {peak.bytes:,} bytes ({both_units(peak.bytes)}), evidence {evidence}"
        if kernels is not None:
            head += f" ({kernels} kernels)"
    if not single_instant:
        where = f"event {peak.event}, {peak.phase}"
        if peak.op:
            where += f", op {peak.op}"
        if peak.module:
            where += f", module {peak.module}"
        head += f" at {where}"
    parts = [head, "  at that instant: " + ", ".join(f"{k} {v:,}" for k, v in _ordered(peak.by_category))]
    total_max = sum(maxima.values())
    if not single_instant:
        over = total_max - peak.bytes
        parts.append(
            f"  sum of per-category maxima {total_max:,} bytes (not simultaneous; overstates the peak by {over:,})"
        )
    return Text("\n".join(parts))


def _ordered(d: dict[str, int]) -> Iterable[tuple[str, int]]:
    order = {c.value: i for i, c in enumerate(CATEGORY_ORDER)}
    return sorted(d.items(), key=lambda kv: order.get(kv[0], 99))


def notes_text(notes: Iterable[str]) -> Text:
    return Text("\n".join(f"note: {n}" for n in notes), style="dim")


def make_console() -> Console:
    """A console that is 120 columns wide when printing to a file or pipe (rich would pick 80)."""
    console = Console()
    return console if console.is_terminal else Console(width=120)


def print_renderables(*items: object, console: Console | None = None) -> None:
    (console or make_console()).print(Group(*items))  # type: ignore[arg-type]


def peak_table(summary: LedgerSummary) -> Table:
    """The breakdown at the peak instant beside each category's own maximum (which need not coincide)."""
    pk = summary.peak
    maxima = summary.category_maxima
    table = Table(title="at the peak instant vs each category's own maximum", title_justify="left", show_footer=True)
    table.add_column("category", footer="total")
    table.add_column("at peak (bytes)", justify="right", footer=f"{pk.bytes:,}")
    table.add_column("share", justify="right", footer="100%")
    table.add_column("category maximum (bytes)", justify="right", footer=f"{sum(maxima.values()):,}")
    order = {c.value: i for i, c in enumerate(CATEGORY_ORDER)}
    for cat in sorted(set(pk.by_category) | set(maxima), key=lambda c: order.get(c, 99)):
        at = pk.by_category.get(cat, 0)
        share = f"{100 * at / pk.bytes:.1f}%" if pk.bytes else "-"
        table.add_row(cat, f"{at:,}", share, f"{maxima.get(cat, 0):,}")
    return table


def lifetime_text(entry: Entry) -> str:
    """``12–40`` on the event clock; ``before``/``after``: it existed before the step or outlives it."""
    start = "before" if entry.alloc_event is None else str(entry.alloc_event)
    stop = "after" if entry.free_event is None else str(entry.free_event)
    return f"{start}–{stop}"


def largest_live_table(entries: Iterable[Entry], event: int) -> Table:
    """The largest arrays live at the peak instant (``Ledger.largest_live``), with where they came from."""
    table = Table(title=f"largest arrays live at the peak (event {event})", title_justify="left")
    for col in ("bytes", "category", "role", "dtype", "shape", "name", "module", "lifetime"):
        table.add_column(col, justify="right" if col == "bytes" else "left")
    for e in entries:
        table.add_row(
            f"{e.nbytes:,}",
            str(e.category),
            e.role,
            short_dtype(e.dtype),
            "×".join(map(str, e.shape)) or "()",
            e.name,
            e.owner,
            lifetime_text(e),
        )
    return table
