"""``trainledger report``: re-open saved output and print it as the command that wrote it did, or as HTML."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import rich.errors
from rich.console import Console
from rich.table import Table
from rich.text import Text

from trainledger.commands import estimate, fit, pareto, plan, shard, state, trace
from trainledger.commands.common import add_json_flag, print_json
from trainledger.errors import InputError
from trainledger.ledger import Ledger
from trainledger.report.saved import RankComparison, Saved, input_files, open_saved
from trainledger.report.terminal import UNITS_NOTE, both_units, make_console, notes_text, print_renderables


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="re-open saved output: the command's tables again, or a self-contained HTML page",
        description="Read what trainledger saved — any command's --json, a ledger (trace --export-json), a plan "
        "(plan --save), or a folder of per-rank ledgers — and print it as the command printed it.",
    )
    p.add_argument(
        "path", metavar="FILE|DIR", help="a JSON file trainledger wrote, or a folder of ledgers (every *.json)"
    )
    p.add_argument(
        "--html",
        metavar="FILE",
        help="also write a self-contained HTML page (.html): timeline, arrays live at any instant, sortable tables",
    )
    add_json_flag(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from trainledger.report.exports import HTML_SUFFIXES, check_output_path
    from trainledger.report.html import write_html

    inputs = input_files(args.path)
    html = check_output_path(args.html, HTML_SUFFIXES, what="HTML report", protect=inputs) if args.html else None
    try:
        saved = open_saved(args.path)
        written = [str(write_html(saved, html, protect=inputs))] if html is not None else []
        if args.json:
            out = to_dict(saved)
            out["written"] = written
            print_json(out)
            return 0
        console = make_console()
        names = ", ".join(str(p) for p in saved.paths[:4]) + (" …" if len(saved.paths) > 4 else "")
        with console.capture() as captured:  # printed once all of it rendered: nothing half-printed on an error
            console.print(Text(f"read {names} ({saved.kind})", style="dim"))
            render(saved, console)
        sys.stdout.write(captured.get())
    except InputError:  # a ValueError too: the reader's own one line, as it is
        raise
    except _EDITED as exc:  # a file that parses but holds values of other types or sizes than trainledger writes
        raise InputError(
            f"{args.path}: a value in it is not what trainledger writes there ({type(exc).__name__}: {exc}); "
            "give a file as trainledger saved it"
        ) from exc
    for path in written:
        console.print(f"wrote {path}")
    return 0


_EDITED = (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError, rich.errors.ConsoleError)


def to_dict(saved: Saved) -> dict[str, Any]:
    """The saved object as JSON again (as read: a ledger keeps its entries)."""
    if saved.kind == "shard-run":
        return dict(saved.result)
    return saved.result.to_dict()


def render(saved: Saved, console: Console) -> None:
    """Print a saved result with the render function of the command that made it."""
    _RENDERERS[saved.kind](saved.result, console)


def render_ledger(ledger: Ledger, console: Console) -> None:
    """A ledger: as ``trace`` prints a traced step, or as ``state`` prints a single instant."""
    from trainledger.trace import TraceReport

    if ledger.num_events == 1 and ledger.events[0].phase == "state":
        from trainledger.state import StateResult

        source = str(ledger.meta.get("model") or f"{ledger.evidence} state")
        state.render(StateResult.of(ledger, source=source), console)
    else:
        trace.render(TraceReport.of(ledger), console)


def render_ranks(comparison: RankComparison, console: Console) -> None:
    """Per-rank ledgers side by side: each rank's peak, the job's peak, and the skew."""
    top = comparison.peak_row
    table = Table(title=f"{len(comparison.rows)} ranks: peak per rank", title_justify="left")
    for col in ("rank", "file", "peak (bytes)", "size", "at event", "largest array at its peak", "its bytes"):
        table.add_column(col, justify="left" if col in ("file", "largest array at its peak") else "right")
    for r in comparison.rows:
        pk = r.summary.peak
        table.add_row(
            str(r.rank), r.path, f"{pk.bytes:,}", both_units(pk.bytes), f"{pk.event} ({pk.phase})",
            r.largest.name if r.largest else "-", f"{r.largest.nbytes:,}" if r.largest else "-",
            style="bold" if r is top else None,
        )  # fmt: skip
    skew = comparison.skew
    lines = [
        f"job peak: rank {top.rank} ({top.path}), {top.summary.peak.bytes:,} bytes "
        f"({both_units(top.summary.peak.bytes)}), evidence {top.summary.evidence}"
    ]
    pk = top.summary.peak
    if top.allocated is not None:
        e = top.allocated
        lines.append(
            f"  reached at event {pk.event} ({pk.phase}{', ' + pk.op if pk.op else ''}), which allocated {e.name}: "
            f"{e.category}/{e.role}, {e.nbytes:,} bytes, module {e.owner or '-'}"
        )
    if top.largest is not None:
        e = top.largest
        lines.append(f"  largest array live then: {e.name}: {e.category}/{e.role}, {e.nbytes:,} bytes")
    lines.append(
        f"skew (largest rank peak / smallest): {skew:.4f}" if skew is not None else "skew: a rank peaks at 0 bytes"
    )
    print_renderables(table, Text("\n".join(lines)), notes_text([UNITS_NOTE]), console=console)


_RENDERERS: dict[str, Callable[[Any, Console], None]] = {
    "ledger": render_ledger,
    "state": state.render,
    "estimate": estimate.render,
    "fit": fit.render,
    "shard": shard.render,
    "shard-run": shard.render_run,
    "trace": trace.render,
    "plan": plan.render,
    "pareto": pareto.render,
    "ranks": render_ranks,
}
