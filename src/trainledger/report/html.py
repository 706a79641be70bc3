"""A self-contained HTML report of a ledger or of any saved result: one file, no network.

The page is one ``.html`` file: its CSS and JavaScript are inline (plain JavaScript, no framework, nothing
fetched), and the data is embedded as JSON in a ``<script type="application/json">`` tag. It shows, as
the saved object allows:

* the peak (or, for a single instant, the total) with its breakdown and the per-category maxima;
* for a ledger with events, a stacked-area timeline of live bytes by category over the event clock
  (drawn as inline SVG; long clocks are drawn one column per pixel, each column the event of largest
  total in it, so the peak is drawn exactly), the peak instant marked, the phase bands, and on hover or
  click the arrays live at that instant (computed only then), largest first;
* a sortable table of every entry;
* for plans and pareto sweeps, the curve of peak against extra compute and the regions recomputed;
* for several ranks, each rank's peak side by side (and the timeline of the rank that sets the job's peak);
* the command's other tables.

After drawing, the page sets ``data-status="ok"`` on ``<body>`` (``"error"`` if anything failed; the
messages are in ``window.__errors`` and in the element ``#errors``), so a headless browser can check it.

Example:
    >>> from trainledger.ledger import Category, Entry, Event, Ledger
    >>> a = Entry("a", Category.ACTIVATIONS, "saved", "float32", 5, 20, alloc_event=0, free_event=1)
    >>> page = html_page(Ledger((a,), (Event(0, "forward"), Event(1, "backward"))))
    >>> page.startswith("<!DOCTYPE html>"), "https://" in page
    (True, False)
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from trainledger.ledger import CATEGORY_ORDER, Entry, EntryGroup, Ledger, LedgerSummary
from trainledger.report._files import HTML_SUFFIXES, atomic_write, check_output_path, peak_label
from trainledger.report.plot import phase_runs
from trainledger.report.saved import RankComparison, Saved
from trainledger.report.terminal import UNITS_NOTE, lifetime_text
from trainledger.units import short_dtype

# Okabe & Ito's palette (Color Universal Design, 2008): distinguishable with the common colour-vision
# deficiencies. The page also names every category in text (legend, tooltips, tables), never by colour alone.
CATEGORY_COLORS: dict[str, str] = {
    "weights": "#0072B2",
    "frozen": "#56B4E9",
    "gradients": "#E69F00",
    "optimizer": "#D55E00",
    "activations": "#009E73",
    "workspace": "#F0E442",
    "inputs": "#CC79A7",
    "communication": "#000000",
    "other": "#999999",
}
PHASE_COLORS: dict[str, str] = {
    "forward": "#eef4fa",
    "backward": "#fbf1e6",
    "optimizer": "#eef7f1",
    "zero_grad": "#f2f2f2",
    "state": "#f7f7f7",
}


def html_page(source: Saved | Ledger, *, title: str | None = None) -> str:
    """The page for a saved result (:func:`~trainledger.report.saved.open_saved`) or a ledger, as text."""
    data = page_data(source, title=title)
    assets = resources.files("trainledger.report") / "assets"
    css = (assets / "report.css").read_text(encoding="utf-8")
    js = (assets / "report.js").read_text(encoding="utf-8")
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    # Inside <script> only "</script" could end the element; escaping <, > and & keeps the JSON valid and inert.
    payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{html.escape(data['title'])}</title>\n"
        f"<style>\n{css}</style>\n</head>\n"
        '<body data-status="loading">\n<main id="report"></main>\n'
        '<pre id="errors" role="alert" hidden></pre>\n'
        f'<script type="application/json" id="trainledger-data">{payload}</script>\n'
        f"<script>\n{js}</script>\n</body>\n</html>\n"
    )


def write_html(
    source: Saved | Ledger,
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    protect: Iterable[str | os.PathLike[str]] = (),
) -> Path:
    """Write :func:`html_page` to ``path`` (``.html``); an input file in ``protect`` is never written over."""
    out = check_output_path(path, HTML_SUFFIXES, what="HTML report", protect=protect)
    text = html_page(source, title=title)
    return atomic_write(out, lambda f: f.write(text), binary=False)


# --- what the page draws -----------------------------------------------------------------------------------


def page_data(source: Saved | Ledger, *, title: str | None = None) -> dict[str, Any]:
    """The JSON the page embeds: a summary, and the sections this kind of result has."""
    if isinstance(source, Ledger):
        source = Saved("ledger", source, ())
    data: dict[str, Any] = {
        "version": 1,
        "title": "",
        "subtitle": ", ".join(p.name for p in source.paths[:8]) + (" …" if len(source.paths) > 8 else ""),
        "summary": None,
        "facts": [],
        "ledger": None,
        "bars": [],
        "pareto": None,
        "tables": [],
        "notes": [],
        "categories": [{"name": c.value, "color": CATEGORY_COLORS[c.value]} for c in CATEGORY_ORDER],
        "phase_colors": PHASE_COLORS,
        "units_note": UNITS_NOTE,
    }
    _SECTIONS[source.kind](data, source.result)
    if title is not None:
        data["title"] = title
    return data


def _summary(s: LedgerSummary) -> dict[str, Any]:
    return {
        "label": peak_label(s, f"{s.peak.bytes:,} bytes"),
        "evidence": str(s.evidence),
        "device": s.device,
        "peak": s.peak.to_dict(),
        "category_maxima": s.category_maxima,
        "sum_of_category_maxima": s.sum_of_category_maxima,
        "num_events": s.num_events,
        "single_instant": s.single_instant,
    }


def compact_ledger(ledger: Ledger) -> dict[str, Any]:
    """A ledger in columns, repeated strings listed once (a 7B trace: about 0.6 MB)."""
    strings: dict[str, int] = {}

    def ref(text: str) -> int:
        return strings.setdefault(text, len(strings))

    cats = {c.value: i for i, c in enumerate(CATEGORY_ORDER)}
    es = ledger.entries
    return {
        "num_events": ledger.num_events,
        "phases": [list(run) for run in phase_runs(ledger)],
        "events": {
            "phase": [ref(ev.phase) for ev in ledger.events],
            "op": [ref(ev.op) for ev in ledger.events],
            "module": [ref(ev.module) for ev in ledger.events],
        },
        "entries": {
            "name": [e.name for e in es],
            "category": [cats[str(e.category)] for e in es],
            "role": [ref(e.role) for e in es],
            "dtype": [ref(short_dtype(e.dtype)) for e in es],
            "shape": [ref("×".join(map(str, e.shape)) or "()") for e in es],
            "bytes": [e.nbytes for e in es],
            "owner": [ref(e.owner) for e in es],
            "alloc": [-1 if e.alloc_event is None else e.alloc_event for e in es],
            "free": [-1 if e.free_event is None else e.free_event for e in es],
        },
        "strings": list(strings),
    }


def _table(title: str, columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[Any]], caption: str = "") -> dict:
    """A sortable table: ``columns`` are ``(label, type)``, type one of text, int, bytes, float, pct."""
    return {
        "title": title,
        "caption": caption,
        "columns": [{"label": label, "type": kind} for label, kind in columns],
        "rows": [list(r) for r in rows],
    }


def _groups_table(title: str, groups: Sequence[EntryGroup]) -> dict:
    columns = [("category", "text"), ("role", "text"), ("dtype", "text"), ("arrays", "int")]
    columns += [("elements", "int"), ("bytes", "bytes"), ("evidence", "text")]
    rows = [
        (g.category, g.role, short_dtype(g.dtype), g.num_arrays, g.numel, g.nbytes, ", ".join(g.evidence))
        for g in groups
    ]
    return _table(title, columns, rows)


def _entries_table(title: str, entries: Iterable[Entry]) -> dict:
    columns = [("name", "text"), ("category", "text"), ("role", "text"), ("dtype", "text"), ("shape", "text")]
    columns += [("bytes", "bytes"), ("module", "text"), ("lifetime", "text")]
    rows = [
        (
            e.name,
            str(e.category),
            e.role,
            short_dtype(e.dtype),
            "×".join(map(str, e.shape)) or "()",
            e.nbytes,
            e.owner,
            lifetime_text(e),
        )
        for e in entries
    ]
    return _table(title, columns, rows)


def _ledger_sections(data: dict[str, Any], ledger: Ledger, summary: LedgerSummary, *, title: str) -> None:
    data["title"] = title
    data["summary"] = _summary(summary)
    data["ledger"] = compact_ledger(ledger)
    data["notes"] = list(summary.notes)


def _title(meta: dict[str, Any], what: str) -> str:
    model = meta.get("model") or meta.get("family")
    return f"{model}: {what}" if model else what


# --- one function per kind of saved result ------------------------------------------------------------------


def _ledger(data: dict[str, Any], ledger: Ledger) -> None:
    summary = ledger.summary()
    what = "training state" if summary.single_instant else "live memory over one training step"
    _ledger_sections(data, ledger, summary, title=_title(ledger.meta, f"{what} ({ledger.evidence}, {ledger.device})"))
    if ledger.meta.get("fake"):
        data["facts"].append("traced on fake tensors: same ops and shapes, nothing allocated")


def _state(data: dict[str, Any], result: Any) -> None:
    _ledger_sections(data, result.ledger, result.ledger.summary(), title=f"persistent state — {result.source}")
    rc = result.recovery
    data["facts"].append(
        f"recovery checkpoint (durable state for a restart; not activation checkpointing): {rc.bytes:,} bytes"
    )
    data["tables"].append(_groups_table("by category, role and dtype", result.ledger.groups()))


def _estimate(data: dict[str, Any], result: Any) -> None:
    s = result.setup
    title = (
        f"{result.spec.family} from {result.source}: micro-batch {s.micro_batch} × {s.seq_len} tokens, "
        f"{s.recipe}, {s.optimizer}, {s.attn_impl}, remat {s.remat} (analytic estimate)"
    )
    _ledger_sections(data, result.ledger, result.ledger.summary(), title=title)
    data["facts"] += [
        f"parameters {result.num_params:,}; trainable {result.num_trainable_params:,}",
        f"activations saved per layer {result.saved_bytes_per_layer:,} bytes",
        "an analytic peak is an estimate; trainledger trace --hf-config ... --fake traces the real step at full size",
    ]
    data["tables"].append(_groups_table("by category, role and dtype", result.ledger.groups()))


def _fit(data: dict[str, Any], result: Any) -> None:
    out = result.to_dict()
    usable = out["usable_bytes"]
    data["title"] = f"{result.source}: what fits {usable:,} usable bytes per device, best first"
    if "peak" in out:
        data["summary"] = _summary(LedgerSummary.from_dict(out))
        data["facts"].append("the peak shown is the best configuration's (analytic estimate of rank 0)")
    if result.options.budget_on == "reserved":
        data["facts"].append(
            "budget on reserved bytes: free is what the caching allocator's model leaves of the usable memory"
        )
    columns = [("micro-batch", "int"), ("ZeRO", "text"), ("remat", "text"), ("precision", "text")]
    peak_col = f"predicted peak ({result.base.device} kernels)"
    columns += [(peak_col, "bytes"), ("free", "bytes"), ("rel. cost", "float"), ("peak in", "text")]
    data["tables"].append(
        _table(
            "fits (best first; cost per token relative to the best)",
            columns,
            [
                (*_setting(c), c.peak_bytes, usable - (c.reserved_bytes or c.peak_bytes), c.relative_cost, c.peak_phase)
                for c in result.fitting
            ],
        )
    )
    columns = [("micro-batch", "int"), ("ZeRO", "text"), ("remat", "text"), ("precision", "text")]
    columns += [(peak_col, "bytes"), ("over by", "bytes"), ("largest at the peak", "text")]
    data["tables"].append(
        _table(
            "does not fit (smallest overflow first)",
            columns,
            [
                (*_setting(c), c.peak_bytes, c.overflow_bytes, f"{c.largest_entry[0]} ({c.largest_entry[1]:,} bytes)")
                for c in result.overflowing
            ],
        )
    )


def _setting(c: Any) -> tuple[Any, ...]:
    """A fit candidate's configuration: micro-batch, ZeRO stage, recomputation, precision."""
    return (c.micro_batch, c.stage[-1], c.remat, c.recipe)


def _shard_summary_sections(data: dict[str, Any], res: Any) -> None:
    """Every rank's peak as bars, rank 0's groups and the collectives (a shard summary)."""
    what = "model states" if res.source_single_instant else "predicted peak"
    data["bars"].append(
        {
            "title": f"{what} per rank ({res.label}, {res.world_size} ranks)",
            "items": [
                {
                    "label": f"rank {r.rank}" if r.num_ranks == 1 else f"ranks {r.rank}-{r.last_rank}",
                    "bytes": r.peak.bytes,
                }
                for r in res.ranks
            ],
        }
    )
    data["tables"].append(_groups_table(f"rank 0 of {res.world_size}, {res.label}", res.rank0_groups))
    columns = [("kind", "text"), ("phase", "text"), ("moves", "text"), ("calls", "int")]
    columns += [("payload", "bytes"), ("sent per rank", "bytes")]
    rows = [(c.kind, c.phase, c.label, c.num_calls, c.payload_bytes, c.wire_bytes) for c in res.collectives]
    data["tables"].append(_table("collectives per rank per step", columns, rows))


def _shard(data: dict[str, Any], report: Any) -> None:
    last = report.results[-1]
    data["title"] = f"{report.source}: {last.world_size} ranks, {last.label}"
    data["summary"] = _summary(last.rank0)
    if len(report.results) > 1:
        columns = [("stage", "text"), ("model states / rank", "bytes"), ("peak of rank 0", "bytes")]
        columns += [("sent per rank", "bytes")]
        rows = [
            (r.label, r.ranks[0].model_state_bytes, r.ranks[0].peak.bytes, sum(c.wire_bytes for c in r.collectives))
            for r in report.results
        ]
        data["tables"].append(_table("per stage (rank 0)", columns, rows))
    _shard_summary_sections(data, last)
    for r in report.results:
        data["notes"] += [n for n in r.notes if n not in data["notes"]]


def _shard_run(data: dict[str, Any], d: dict[str, Any]) -> None:
    run = d["run"]
    data["title"] = f"{run['model']}: {run['world_size']} ranks, {run['engine']}, {run['backend']} (run)"
    data["summary"] = _summary(LedgerSummary.from_dict(d))
    columns = [("rank", "int"), ("predicted peak", "bytes"), ("traced peak", "bytes"), ("error", "pct")]
    columns += [("collective bytes", "bytes"), ("wait s", "float"), ("step s", "float")]
    keys = ("rank", "predicted_peak_bytes", "traced_peak_bytes", "relative_error", "collective_bytes")
    rows = [[r[k] for k in (*keys, "wait_seconds", "step_seconds")] for r in d["ranks"]]
    data["tables"].append(_table("predicted against traced, per rank", columns, rows))
    data["bars"].append(
        {
            "title": "traced peak per rank",
            "items": [{"label": f"rank {r['rank']}", "bytes": r["traced_peak_bytes"] or 0} for r in d["ranks"]],
        }
    )
    data["notes"] = list(d.get("run_notes", ()))


def _trace(data: dict[str, Any], report: Any) -> None:
    s = report.ledger
    data["title"] = _title(s.meta, f"one traced training step ({s.evidence}, {s.device})")
    data["summary"] = _summary(s)
    data["facts"].append(
        f"{s.num_events:,} events, {report.num_entries:,} storages; saved without its entries "
        "(trace --export-json or trace --html keeps them, with the timeline)"
    )
    data["tables"].append(
        _entries_table(f"largest arrays live at the peak (event {s.peak.event})", report.largest_live)
    )
    m = report.measured
    if m is not None:
        data["facts"].append(
            f"measured peak {m.peak_bytes:,} bytes on {m.device}; traced {m.traced_peak.bytes:,}; "
            f"not visible as tensors {m.unseen_workspace_bytes:,} bytes"
        )
    if report.sharded is not None:
        _shard_summary_sections(data, report.sharded)
    data["notes"] = list(s.notes)


def _plan(data: dict[str, Any], result: Any) -> None:
    p = result.plan
    data["title"] = f"{p.model or 'the model'}: activation recomputation plan ({p.solver or 'saved'})"
    if result.predicted is not None:
        data["summary"] = _summary(result.predicted)
        data["facts"].append("the peak shown is predicted: the plain step's trace with the plan replayed on it")
    if p.extra_flops is not None and p.extra_seconds is not None:
        data["facts"].append(
            f"extra compute: {p.extra_flops:,} FLOPs recomputed in backward, {p.extra_seconds * 1e3:.2f} ms measured"
        )
    items = [("plain step's traced peak", p.plain_peak_bytes), ("budget", p.budget_bytes)]
    items += [("predicted with the plan", p.predicted_peak_bytes), ("floor (lowest any plan reaches)", p.floor_bytes)]
    if result.verification is not None:
        items.append(("traced with the plan applied", result.verification.traced_peak_bytes))
    data["bars"].append(
        {"title": "the plan against its budget", "items": [{"label": k, "bytes": v} for k, v in items if v is not None]}
    )
    timed = p.extra_seconds is not None and all(b.extra_seconds is not None for b in result.baselines)
    data["pareto"] = {
        "title": "the plan: peak against extra compute, beside the plans people use",
        "cost": "seconds" if timed else "flops",
        "plain_peak_bytes": p.plain_peak_bytes,
        "floor_bytes": p.floor_bytes,
        "series": [{"name": "this plan", "points": [_point_of_plan(p)]}, *_baseline_series(result.baselines)],
    }
    columns = [("module", "text"), ("policy", "text"), ("saved bytes", "bytes"), ("recompute transient", "bytes")]
    columns += [("recompute FLOPs", "int"), ("recompute ms", "float")]
    rows = []
    for r, c in result.recomputed():
        figures = (
            (c.saved_bytes, c.recompute_transient_bytes, c.recompute_flops, c.recompute_seconds * 1e3)
            if c is not None
            else (None, None, None, None)
        )
        policy = r.description
        rows.append((r.where, policy, *figures))
    data["tables"].append(_table("regions recomputed (non-reentrant torch.utils.checkpoint)", columns, rows))
    if result.baselines:
        data["tables"].append(_plan_baselines_table(result, timed=p.extra_seconds is not None))
    data["notes"] = list(p.notes)


def _plan_baselines_table(result: Any, *, timed: bool) -> dict:
    """The plan beside the named baselines, with the figures ``trainledger plan`` prints."""
    p = result.plan
    columns = [("plan", "text"), ("peak bytes", "bytes"), ("extra FLOPs", "int"), ("other ops", "int")]
    columns += [*((("ms", "float"),) if timed else ()), ("regions", "int"), ("note", "text")]

    def row(name: str, peak: Any, flops: Any, other: Any, seconds: Any, n: Any, note: str) -> tuple[Any, ...]:
        ms = (None if seconds is None else seconds * 1e3,) if timed else ()
        return (name, peak, flops, other, *ms, n, note)

    rows = [
        row(
            "this plan", p.predicted_peak_bytes, p.extra_flops, p.extra_other_flops, p.extra_seconds, len(p.regions), ""
        )
    ]
    for b in result.baselines:
        if b.choice is None:
            rows.append(row(b.label, None, None, None, None, None, b.note))
        else:
            rows.append(
                row(b.label, b.peak_bytes, b.extra_flops, b.extra_other_flops, b.extra_seconds, len(b.choice), b.note)
            )
    caption = "other ops: the cost charged to ops FlopCounterMode counts 0, one FLOP per output element"
    return _table("beside the plans people use (predicted on the same trace)", columns, rows, caption)


def _baseline_series(baselines: Iterable[Any]) -> list[dict[str, Any]]:
    """One chart series per named baseline that this model can express (its predicted peak and cost)."""
    return [
        {
            "name": b.label,
            "points": [
                {
                    "peak_bytes": b.peak_bytes,
                    "extra_seconds": b.extra_seconds,
                    "extra_flops": b.extra_flops,
                    "extra_other_flops": b.extra_other_flops,
                    "regions": [f"{len(b.choice)} regions"] if b.choice else [],
                }
            ],
        }
        for b in baselines
        if b.peak_bytes is not None and b.choice is not None
    ]


def _point_of_plan(p: Any) -> dict[str, Any]:
    return {
        "peak_bytes": p.predicted_peak_bytes,
        "extra_seconds": p.extra_seconds,
        "extra_flops": p.extra_flops,
        "extra_other_flops": p.extra_other_flops,
        "regions": [r.label for r in p.regions],
    }


def _pareto(data: dict[str, Any], result: Any) -> None:
    data["title"] = f"{result.model}: peak against extra compute, plain peak down to the floor"
    data["summary"] = _summary(result.plain)
    data["facts"].append("the peak shown is the plain step's (no recomputation)")

    def points(pts: Iterable[Any]) -> list[dict[str, Any]]:
        return [p.to_dict() for p in pts if p is not None]

    on = "predicted reserved bytes" if result.budget_on == "reserved" else "allocated bytes"
    data["facts"].append(f"every budget of the sweep is on {on}")
    data["pareto"] = {
        "title": "peak against extra compute in backward",
        "cost": result.cost,
        "budget_on": result.budget_on,
        "plain_peak_bytes": result.plain_peak_bytes,
        "floor_bytes": result.floor_bytes,
        "series": [
            {"name": "ours (DP / MILP)", "points": points(r.ours for r in result.rows)},
            {"name": "MILP optimum", "points": points(r.milp for r in result.rows)},
            {"name": "greedy knapsack", "points": points(r.greedy for r in result.rows)},
            {"name": "uniform per-block", "points": points([result.uniform])},
            {"name": "Chen's sqrt(n)", "points": points([result.sqrt_n])},
            *_baseline_series(result.baselines),
        ],
    }
    columns = [(f"budget on {on}", "bytes"), ("fits", "text"), ("ours: peak", "bytes"), ("ours: reserved", "bytes")]
    columns += [("ours: extra ms", "float"), ("ours: extra FLOPs", "int"), ("MILP ms", "float"), ("greedy ms", "float")]
    columns += [("recomputed", "text")]

    def ms(p: Any) -> float | None:
        return p.extra_seconds * 1e3 if p is not None else None

    rows = [
        (
            r.budget_bytes,
            "yes" if r.fits else "NO",
            r.ours.peak_bytes if r.ours else None,
            r.ours.reserved_peak_bytes if r.ours else None,
            ms(r.ours),
            r.ours.extra_flops if r.ours else None,
            ms(r.milp),
            ms(r.greedy),
            ", ".join(r.ours.regions) if r.ours else "no plan",
        )
        for r in result.rows
    ]
    title = f"cheapest recomputation per budget on {on} (the plan's regions)"
    data["tables"].append(_table(title, columns, rows))
    if result.baselines:
        data["tables"].append(_pareto_baselines_table(result))
    data["notes"] = list(result.candidate_notes)


def _pareto_baselines_table(result: Any) -> dict:
    """Each named baseline beside our plan at the baseline's own peak, as ``trainledger pareto`` prints it."""
    seconds = result.cost == "seconds"
    unit, kind = ("ms", "float") if seconds else ("FLOPs", "int")
    columns = [("baseline", "text"), ("peak", "bytes"), (f"its extra {unit}", kind), (f"ours: extra {unit}", kind)]
    columns += [("ours: peak", "bytes"), ("note", "text")]
    rows = []
    for b, o in zip(result.baselines, result.at_baselines, strict=True):
        if b.peak_bytes is None:
            rows.append((b.label, None, None, None, None, b.note))
            continue
        cost = (b.extra_seconds or 0.0) * 1e3 if seconds else b.cost_flops
        ours = None if o is None else (o.cost("seconds") * 1e3 if seconds else int(o.cost("flops")))
        rows.append((b.label, b.peak_bytes, cost, ours, None if o is None else o.peak_bytes, b.note))
    caption = "" if seconds else "FLOPs: FlopCounterMode's, plus one per output element of the other recomputed ops"
    return _table("named baselines, and our plan with each one's peak as the budget", columns, rows, caption)


def _ranks(data: dict[str, Any], comparison: RankComparison) -> None:
    top = comparison.peak_row
    _ledger_sections(
        data,
        comparison.peak_ledger,
        top.summary,
        title=f"{len(comparison.rows)} ranks: the job's peak is rank {top.rank}'s ({top.path})",
    )
    skew = comparison.skew
    data["facts"].append(
        f"job peak on rank {top.rank}: {top.summary.peak.bytes:,} bytes"
        + (
            f", reached when {top.allocated.name} ({top.allocated.nbytes:,} bytes) was allocated"
            if top.allocated
            else ""
        )
        + (f"; skew (largest rank peak / smallest) {skew:.4f}" if skew is not None else "")
        + f"; the timeline below is rank {top.rank}'s"
    )
    data["bars"].append(
        {
            "title": "peak per rank",
            "items": [{"label": f"rank {r.rank}", "bytes": r.summary.peak.bytes} for r in comparison.rows],
        }
    )
    columns = [("rank", "int"), ("file", "text"), ("evidence", "text"), ("peak", "bytes"), ("event", "int")]
    columns += [("phase", "text"), ("largest array at its peak", "text"), ("its bytes", "bytes")]
    rows = [
        (r.rank, r.path, str(r.summary.evidence), r.summary.peak.bytes, r.summary.peak.event, r.summary.peak.phase)
        + ((r.largest.name, r.largest.nbytes) if r.largest else ("", None))
        for r in comparison.rows
    ]
    data["tables"].append(_table("ranks side by side", columns, rows))


_SECTIONS = {
    "ledger": _ledger,
    "state": _state,
    "estimate": _estimate,
    "fit": _fit,
    "shard": _shard,
    "shard-run": _shard_run,
    "trace": _trace,
    "plan": _plan,
    "pareto": _pareto,
    "ranks": _ranks,
}
