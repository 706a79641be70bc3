"""`trainledger report` re-opens every saved schema and prints what the producing command printed; the HTML
page it writes is checked in a headless Chromium (skipped when no Chromium is installed).

Oracles: the producing command's own output (text and JSON) for the same result, the ledger's own
``peak()`` and ``live_at()``, and the pixels of a screenshot.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
from rich.console import Console

from tests.conftest import traced_example
from trainledger.examples import gpt_tiny
from trainledger.ledger import Category, Entry, Event, Evidence, Ledger
from trainledger.report.exports import write_ledger_json
from trainledger.report.html import CATEGORY_COLORS, compact_ledger, html_page, write_html
from trainledger.report.saved import RankComparison

LLAMA = "tests/fixtures/hf/llama-small.json"
SMALL_GPT = """
from trainledger.examples import gpt_tiny
def small():
    return gpt_tiny(n_layer=2, seq_len=32)
"""


@pytest.fixture(scope="module")
def traced() -> Ledger:
    return traced_example("gpt-tiny")


@pytest.fixture
def small_gpt(tmp_path) -> str:
    f = tmp_path / "small_gpt.py"
    f.write_text(SMALL_GPT)
    return f"{f}:small"


def _text(out: str) -> str:
    """A command's printed text without the lines that name files (``read …``, ``wrote …``)."""
    return "\n".join(line for line in out.splitlines() if not line.startswith(("read ", "wrote ")))


def _rendered(render, result) -> str:
    """What a command's ``render`` prints for ``result`` (as on a 120-column pipe, like the CLI)."""
    buf = io.StringIO()
    render(result, Console(file=buf, width=120))
    return buf.getvalue()


_RUNS: dict[tuple[str, ...], str] = {}
"""A deterministic command's printed output, by its arguments (``--json`` last for the JSON): run once for the
tests of this file (strings: no test can change what another reads)."""


def _printed(cli, tmp_path: Path, *argv: str) -> str:
    if argv not in _RUNS or any(a.startswith(str(tmp_path)) for a in argv):
        code, out, err = cli(*argv)
        assert code == 0, err
        _RUNS[argv] = out
    return _RUNS[argv]


def _saved(cli, tmp_path: Path, name: str, *argv: str, text: bool = False) -> tuple[Path, dict, str | None]:
    """Run a command with --json into a file and, with ``text``, once more without; returns (file, its JSON, the
    text or None)."""
    out = _printed(cli, tmp_path, *argv, "--json")
    path = tmp_path / name
    path.write_text(out)
    return path, json.loads(out), _printed(cli, tmp_path, *argv) if text else None


def _report(cli, *argv: str) -> str:
    code, out, err = cli("report", *argv)
    assert code == 0, err
    return out


def _report_json(cli, path: Path) -> dict:
    d = json.loads(_report(cli, str(path), "--json"))
    d.pop("written")
    return d


# --- every schema, re-opened: the same tables, the same JSON -------------------------------------------------

DETERMINISTIC = {
    "state-model": ("state", "--model", "seed-423"),
    "state-params": ("state", "--params", "1e9", "--master", "fp32"),
    "estimate": ("estimate", "--hf-config", LLAMA, "--world", "4", "--stage", "2"),
    "fit": ("fit", "--hf-config", LLAMA, "--device-memory", "2GiB", "--world", "2", "--traced-top", "1"),
    "shard-params-all": (
        *("shard", "--params", "7.5e9", "--weights", "fp16", "--master", "fp32", "--grads", "fp16"),
        *("--world", "64", "--stage", "all", "--link-gbps", "100"),
    ),
    "shard-model": ("shard", "--model", "gpt-tiny", "--world", "2", "--stage", "3"),
    "trace": ("trace", "--model", "gpt-tiny"),
    "trace-sharded": ("trace", "--model", "mlp", "--world", "4", "--stage", "1"),
}


@pytest.mark.parametrize("name", list(DETERMINISTIC))
def test_report_prints_what_the_command_printed(cli, tmp_path, name):
    """Every number of the command's tables, byte for byte: the command was run twice (deterministic)."""
    path, original, text = _saved(cli, tmp_path, f"{name}.json", *DETERMINISTIC[name], text=True)
    out = _report(cli, str(path))
    assert out.splitlines()[0] == f"read {path} ({original.get('result')})"
    assert _text(out) == _text(text)
    original.pop("written", None)
    assert _report_json(cli, path) == original  # read back exactly: to_dict(from_dict(d)) == d


def test_report_of_an_exported_ledger_prints_the_trace(cli, tmp_path):
    ledger_json = tmp_path / "step.json"
    code, text, err = cli("trace", "--model", "gpt-tiny", "--export-json", str(ledger_json))
    assert code == 0, err
    out = _report(cli, str(ledger_json))
    assert out.splitlines()[0] == f"read {ledger_json} (ledger)"
    assert _text(out) == _text(text)
    assert "peak 11,533,528 bytes" in out  # the README's figure, exact
    assert _report_json(cli, ledger_json) == json.loads(ledger_json.read_text())


def test_trace_measure_round_trip(cli, tmp_path):
    from trainledger.commands import trace as trace_cmd
    from trainledger.trace import TraceReport

    path, original, _ = _saved(cli, tmp_path, "m.json", "trace", "--model", "mlp", "--measure")
    report = TraceReport.from_dict(original)
    assert report.measured is not None
    assert report.measured.unseen_workspace_bytes == original["measured"]["unseen_workspace_bytes"]
    assert _text(_report(cli, str(path))) == _text(_rendered(trace_cmd.render, report))
    original.pop("written")
    assert _report_json(cli, path) == original


def test_plan_files_round_trip(cli, tmp_path, small_gpt):
    """plan --json and plan --save: the same regions, budget and predicted peak as printed by plan."""
    from trainledger.commands import plan as plan_cmd
    from trainledger.remat import PlanResult

    saved = tmp_path / "plan.json"
    path, original, _ = _saved(cli, tmp_path, "plan-out.json", "plan", "--model", small_gpt, "--budget", "80%")
    code, _, err = cli("plan", "--model", small_gpt, "--budget", "80%", "--save", str(saved))
    assert code == 0, err
    out = _report(cli, str(path))
    assert _text(out) == _text(_rendered(plan_cmd.render, PlanResult.from_dict(original)))
    assert f"budget {original['budget_bytes']:,} bytes" in out
    assert f"peak {original['predicted_peak_bytes']:,} bytes" in out
    for region in original["regions"]:
        assert region["path"] in out
    assert _report_json(cli, path) == original
    # a saved plan holds the regions and the prediction, not the candidates' costs: those print as "-"
    out = _report(cli, str(saved))
    assert f"peak {original['predicted_peak_bytes']:,} bytes" in out and "persistent state and the largest" not in out


@pytest.mark.slow
def test_verified_plan_keeps_the_prediction_beside_the_retrace(tmp_path, cli):
    from trainledger.commands import plan as plan_cmd
    from trainledger.remat import plan_and_verify

    result = plan_and_verify(gpt_tiny(), "60%", verify=True)
    path = tmp_path / "verified.json"
    path.write_text(json.dumps(result.to_dict()))
    out = _report(cli, str(path))
    assert _text(out) == _text(_rendered(plan_cmd.render, result))
    v = result.verification
    assert f"traced peak {v.traced_peak_bytes:,} bytes, predicted {v.predicted_peak_bytes:,}" in out
    assert f"peak {result.predicted.peak.bytes:,} bytes" in out  # the prediction, not the re-trace
    assert _report_json(cli, path) == result.to_dict()


def test_pareto_round_trip(tmp_path, cli):
    from trainledger.commands import pareto as pareto_cmd
    from trainledger.examples import gpt_tiny as build
    from trainledger.remat import pareto

    result = pareto(build(n_layer=2, seq_len=32), num_budgets=3)
    path = tmp_path / "pareto.json"
    path.write_text(json.dumps(result.to_dict()))
    out = _report(cli, str(path))
    assert _text(out) == _text(_rendered(pareto_cmd.render, result))
    assert f"plain step's traced peak {result.plain_peak_bytes:,} bytes" in out
    assert _report_json(cli, path) == result.to_dict()


@pytest.mark.slow
def test_pareto_command_output_round_trips(tmp_path, cli):
    from trainledger.commands import pareto as pareto_cmd

    path, original, _ = _saved(cli, tmp_path, "p.json", "pareto", "--model", "gpt-tiny", "--budgets", "3")
    from trainledger.remat import ParetoResult

    assert _text(_report(cli, str(path))) == _text(_rendered(pareto_cmd.render, ParetoResult.from_dict(original)))
    original.pop("written")
    assert _report_json(cli, path) == original


@pytest.mark.slow
def test_shard_run_round_trip(tmp_path, cli):
    from trainledger.commands import shard as shard_cmd

    code, out, err = cli("shard", "--model", "mlp", "--world", "2", "--stage", "1", "--run", "--json")
    assert code == 0, err
    path = tmp_path / "run.json"
    path.write_text(out)
    d = json.loads(out)
    text = _report(cli, str(path))
    assert _text(text) == _text(_rendered(shard_cmd.render_run, d))
    for r in d["ranks"]:
        assert f"{r['traced_peak_bytes']:,}" in text


# --- a folder of per-rank ledgers ---------------------------------------------------------------------------


@pytest.fixture
def rank_folder(tmp_path, traced) -> tuple[Path, tuple[Ledger, ...]]:
    """Four ranks of ZeRO-1 as PyTorch runs it: whole parameters per rank, so the ranks differ."""
    from trainledger.shard import shard

    ranks = shard(traced, world_size=4, strategy="zero1", engine="torch").ranks
    folder = tmp_path / "ranks"
    folder.mkdir()
    for r, led in enumerate(ranks):
        write_ledger_json(led, folder / f"rank{r}.json")
    return folder, ranks


def test_rank_folder_comparison(cli, rank_folder):
    folder, ranks = rank_folder
    peaks = [led.peak().bytes for led in ranks]
    assert len(set(peaks)) > 1, "the ranks should differ for this test to mean something"
    top = max(range(4), key=lambda r: (peaks[r], -r))
    out = _report(cli, str(folder))
    for r in range(4):
        assert re.search(rf"│\s+{r} │ rank{r}\.json\s+│\s+{peaks[r]:,} │", out), out
    assert f"job peak: rank {top} (rank{top}.json), {peaks[top]:,} bytes" in out
    pk = ranks[top].peak()
    live = ranks[top].live_at(pk.event)
    largest = max(live, key=lambda e: e.nbytes)
    allocated = max((e for e in live if e.alloc_event == pk.event), key=lambda e: e.nbytes)
    flat = " ".join(out.split())  # the console wraps long lines
    assert (
        f"which allocated {allocated.name}: {allocated.category}/{allocated.role}, {allocated.nbytes:,} bytes" in flat
    )
    assert f"largest array live then: {largest.name}: {largest.category}/{largest.role}, {largest.nbytes:,}" in flat
    assert f"skew (largest rank peak / smallest): {max(peaks) / min(peaks):.4f}" in out
    d = json.loads(_report(cli, str(folder), "--json"))
    assert d["schema"] == "trainledger.ranks/1" and d["peak_rank"] == top and d["peak"]["bytes"] == peaks[top]
    assert d["skew"] == max(peaks) / min(peaks)
    assert [r["peak"]["bytes"] for r in d["ranks"]] == peaks
    assert d["largest_at_peak"]["nbytes"] == largest.nbytes and d["allocated_at_peak"]["name"] == allocated.name


def test_rank_comparison_orders_by_meta_rank_and_refuses_duplicates():
    def led(rank: int, n: int) -> Ledger:
        return Ledger((Entry("w", Category.WEIGHTS, "param", "float32", n, 4 * n),), meta={"rank": rank})

    c = RankComparison.of([("b.json", led(1, 10)), ("a.json", led(0, 30))])
    assert [r.rank for r in c.rows] == [0, 1] and c.peak_row.path == "a.json" and c.skew == 3.0
    from trainledger.errors import InputError

    with pytest.raises(InputError, match="both say they are rank 0"):
        RankComparison.of([("a.json", led(0, 1)), ("b.json", led(0, 2))])
    other = Ledger(led(1, 10).entries, meta={"rank": 1, "model": "Sequential"})
    with pytest.raises(InputError, match=r"of different models \(\?, Sequential\)"):  # not ranks of one step
        RankComparison.of([("a.json", led(0, 30)), ("b.json", other)])


def test_folder_with_a_non_ledger_is_refused(cli, rank_folder, tmp_path):
    folder, _ = rank_folder
    code, out, _ = cli("state", "--params", "1e6", "--json")
    (folder / "state.json").write_text(out)
    code, _, err = cli("report", str(folder))
    assert code == 2 and "is a state result, not a ledger" in err and len(err.strip().splitlines()) == 1


# --- bad input: one line, exit 2, nothing run or written ------------------------------------------------------


class _Touch:
    """Unpickling this creates a file: the proof that a pickle was (or was not) unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("not json at all", "is not JSON"),
        ("[1, 2]", "holds a JSON list"),
        ('{"schema": "something/9"}', "has schema 'something/9'; accepted: "),
        ('{"schema": "trainledger.ledger/1", "peak": {}}', "without entries and without a 'result' key"),
        ('{"schema": "trainledger.ledger/1", "result": "nope"}', "has result 'nope'; accepted:"),
        ('{"schema": "trainledger.ledger/1", "result": "state"}', "is not a valid state file (missing key"),
        ('{"schema": "trainledger.remat-plan/1"}', "the plan file is missing key 'regions'"),
        ('{"schema": ' + "[" * 100_000 + "]" * 100_000 + "}", "never writes (nested too deeply)"),
        ('{"schema": ' + "9" * 5000 + "}", "never writes (Exceeds the limit (4300 digits)"),
        ('{"schema": "trainledger.ledger/1", "entries": [{"name": 1}], "events": []}', "is not a valid ledger"),
    ],
)
def test_bad_files(cli, tmp_path, content, fragment):
    path = tmp_path / "bad.json"
    path.write_text(content)
    code, out, err = cli("report", str(path))
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1 and not out
    assert "Traceback" not in err


def _edit(key_path: str, value):
    """A function setting ``value`` at a dotted key path (``entries.3.nbytes``) of a JSON object."""

    def edit(data: dict) -> None:
        *keys, last = [int(k) if k.isdigit() else k for k in key_path.split(".")]
        for k in keys:
            data = data[k]
        data[last] = value

    return edit


def _first_temporary(data: dict) -> int:
    return next(i for i, e in enumerate(data["entries"]) if e["alloc_event"])


@pytest.mark.parametrize(
    ("kind", "edit", "fragment"),
    [
        ("ledger", _edit("device", None), "(Ledger.device is None, not str)"),
        ("ledger", _edit("entries.0.nbytes", -5), "holds -5 bytes"),
        ("ledger", lambda d: d["entries"][_first_temporary(d)].update(free_event=0), "before it is allocated"),
        ("ledger", _edit("entries.0.shape", ["big"]), "Ledger.entries[0].shape[0] is a str 'big', not int"),
        ("trace", _edit("peak.bytes", "big"), "peak bytes must be a whole number"),
        ("plan", _edit("budget_bytes", "big"), "the plan's budget_bytes 'big' is a str"),
        ("plan", _edit("budget_bytes", -5), "the plan's budget_bytes -5 must be at least 0"),
        ("plan", _edit("regions.0.policy", "bogus"), "unknown recomputation policy 'bogus'; accepted: full"),
        ("plan", _edit("regions", [1, 2]), "a region is an int 1, not an object"),
        ("plan", _edit("regions.0.num_calls", 0), "a region's num_calls 0 must be at least 1"),  # a modulo by zero
        ("plan", _edit("regions.0.call", "1"), "a region's call '1' is a str"),
        ("estimate", _edit("spec.num_layers", 10**30), "spec.num_layers is 1,000,000,000,000,000,000,000,000,000,000"),
    ],
)
def test_hand_edited_files_are_refused_naming_the_value(cli, tmp_path, traced, small_gpt, kind, edit, fragment):
    """A file trainledger wrote, one value edited: refused in one line, never printed as if it were valid."""
    if kind == "ledger":
        data = json.loads(write_ledger_json(traced, tmp_path / "step.json").read_text())
    elif kind in ("trace", "estimate", "fit"):
        data = json.loads(_printed(cli, tmp_path, *DETERMINISTIC[kind], "--json"))
    else:
        data = json.loads(_printed(cli, tmp_path, "plan", "--model", small_gpt, "--budget", "80%", "--json"))
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    for json_flag in ((), ("--json",)):
        code, out, err = cli("report", str(path), *json_flag)
        assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1 and not out, err


@pytest.mark.parametrize(
    ("kind", "edit", "fragment"),
    [
        ("ledger", _edit("meta.events_per_phase", None), "AttributeError: 'NoneType' object has no attribute"),
        ("trace", _edit("largest_live_at_peak.0.name", 7), "NotRenderableError"),
        ("trace", _edit("largest_live_at_peak.0.dtype", ["bf16"]), "TypeError: unhashable type: 'list'"),
        ("fit", _edit("fits.0.relative_cost", None), "TypeError: unsupported format string passed to NoneType"),
    ],
)
def test_a_value_of_another_type_is_one_line_when_printed(cli, tmp_path, traced, kind, edit, fragment):
    """Values the reader passes on as they are (``--json`` gives them back) but the printing cannot show: each
    was a traceback, after part of the report had been printed. Now one line and nothing printed."""
    if kind == "ledger":
        data = json.loads(write_ledger_json(traced, tmp_path / "step.json").read_text())
    else:
        data = json.loads(_printed(cli, tmp_path, *DETERMINISTIC[kind], "--json"))
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    code, out, err = cli("report", str(path))
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1 and not out, err
    assert "not what trainledger writes there" in err


def test_a_pickle_is_refused_and_never_unpickled(cli, tmp_path):
    marker = tmp_path / "unpickled"
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(_Touch(marker), protocol=4))
    code, _, err = cli("report", str(path))
    assert code == 2 and "is a pickle" in err and "never unpickles" in err
    assert not marker.exists()
    pickle.loads(path.read_bytes())  # the test's own check that the file would have acted when unpickled
    assert marker.exists()


def test_missing_paths_and_empty_folders(cli, tmp_path):
    code, _, err = cli("report", str(tmp_path / "nope.json"))
    assert code == 2 and "no such file or folder" in err
    code, _, err = cli("report", str(tmp_path))
    assert code == 2 and "holds no .json files" in err
    (tmp_path / "step-1").mkdir()  # a callback's output folder: one folder of ledgers per recorded step
    (tmp_path / "step-1" / "rank-0.json").write_text("{}")
    code, _, err = cli("report", str(tmp_path))
    assert code == 2 and "its folders step-1 do: give one of them" in err and str(tmp_path / "step-1") in err


def test_html_output_is_checked_before_reading_and_never_overwrites_an_input(cli, tmp_path, traced):
    ledger_json = write_ledger_json(traced, tmp_path / "step.json")
    before = ledger_json.read_bytes()
    for target, fragment in [
        (ledger_json, "has suffix '.json'; accepted: .html, .htm"),
        (tmp_path / "missing" / "r.html", "does not exist"),
    ]:
        code, _, err = cli("report", str(ledger_json), "--html", str(target))
        assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1
    as_html = tmp_path / "step.html"
    as_html.write_text(json.dumps(traced.to_dict()))  # an input that happens to end in .html
    code, _, err = cli("report", str(as_html), "--html", str(as_html))
    assert code == 2 and "is one of the inputs; refusing to overwrite it" in err
    assert ledger_json.read_bytes() == before and json.loads(as_html.read_text())["schema"]


def test_trace_html_is_checked_before_the_step_runs(cli, tmp_path):
    code, _, err = cli("trace", "--model", "gpt-tiny", "--html", str(tmp_path / "no" / "step.html"))
    assert code == 2 and "folder" in err and "does not exist" in err
    code, _, err = cli("trace", "--model", "gpt-tiny", "--html", str(tmp_path / "step.png"))
    assert code == 2 and "accepted: .html, .htm" in err


def test_a_config_read_from_a_folder_or_for_diffusers_is_never_overwritten(cli, tmp_path):
    fixtures = Path(__file__).parent / "fixtures" / "hf"
    folder = tmp_path / "bert"
    folder.mkdir()
    config = folder / "config.json"
    config.write_bytes((fixtures / "bert-tiny.json").read_bytes())
    unet = tmp_path / "unet.json"
    unet.write_bytes((fixtures / "sd15-unet-tiny-diffusers.json").read_bytes())
    before = {config: config.read_bytes(), unet: unet.read_bytes()}
    for argv in [
        ("trace", "--hf-config", str(folder), "--fake", "--export-json", str(config)),
        ("trace", "--hf-config", str(folder), "--fake", "--export-perfetto", str(config)),
        ("trace", "--diffusers-config", str(unet), "--fake", "--export-json", str(unet)),
    ]:
        code, _, err = cli(*argv)
        assert code == 2 and "is one of the inputs; refusing to overwrite it" in err, (argv, err)
    assert {p: p.read_bytes() for p in before} == before


# --- the page's data, checked in Python ----------------------------------------------------------------------


def _page_data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="trainledger-data">(.*?)</script>', page, re.S)
    assert m is not None
    return json.loads(m.group(1))


def test_page_is_self_contained_and_embeds_the_ledger(traced):
    page = html_page(traced)
    for fetch in ("<link", " src=", " href=", "url(", "@import", "fetch(", "XMLHttpRequest", "import("):
        assert fetch not in page, fetch
    data = _page_data(page)
    assert data["summary"]["peak"]["bytes"] == traced.peak().bytes
    L = data["ledger"]
    assert L["num_events"] == traced.num_events and len(L["entries"]["bytes"]) == len(traced.entries)
    # the columns give back every entry's bytes and interval
    for i in (0, len(traced.entries) // 2, len(traced.entries) - 1):
        e = traced.entries[i]
        assert L["entries"]["bytes"][i] == e.nbytes and L["entries"]["name"][i] == e.name
        assert L["entries"]["alloc"][i] == (-1 if e.alloc_event is None else e.alloc_event)
        assert L["strings"][L["entries"]["owner"][i]] == e.owner


def test_page_escapes_what_would_end_its_script():
    evil = Entry("</script><script>alert(1)</script>", Category.WEIGHTS, "param", "float32", 1, 4)
    page = html_page(Ledger((evil,)))
    assert page.count("</script>") == 2  # the data tag's and the code's, nothing from the data
    assert _page_data(page)["ledger"]["entries"]["name"] == [evil.name]


def test_compact_ledger_of_a_tiny_step():
    a = Entry("a", Category.ACTIVATIONS, "saved", "float32", 5, 20, alloc_event=0, free_event=1)
    led = Ledger((a,), (Event(0, "forward", "aten.mm", "fc"), Event(1, "backward", "aten.mm", "fc")))
    L = compact_ledger(led)
    assert L["phases"] == [["forward", 0, 1], ["backward", 1, 2]]
    assert [L["strings"][i] for i in L["events"]["op"]] == ["aten.mm", "aten.mm"]
    assert L["entries"]["category"] == [4]  # activations in the fixed category order


def test_trace_writes_the_page(cli, tmp_path):
    page = tmp_path / "step.html"
    code, out, err = cli("trace", "--model", "mlp", "--html", str(page))
    assert code == 0, err and f"wrote {page}" in out
    data = _page_data(page.read_text())
    assert data["summary"]["peak"]["bytes"] == 1_061_248  # the README's figure for mlp


def _terminal_row(text: str, label: str) -> str:
    """The line of a printed table whose first cell starts ``label`` (a long label wraps onto more lines)."""

    def first_cell(line: str) -> str:
        cells = line.split("│")
        return cells[1].strip() if len(cells) > 2 else line.strip()[:30]

    return next(line for line in text.splitlines() if first_cell(line) and label.startswith(first_cell(line)))


def _baselines_on_the_page(data: dict, title: str, peak_col: str, cost_col: str) -> dict[str, tuple]:
    """Per baseline label: its point on the chart (``None``: not drawn) and its table row's peak and cost."""
    table = next(t for t in data["tables"] if t["title"].startswith(title))
    cols = [c["label"] for c in table["columns"]]
    series = {s["name"]: s["points"] for s in data["pareto"]["series"]}
    return {
        row[0]: (series.get(row[0]), row[cols.index(peak_col)], row[cols.index(cost_col)])
        for row in table["rows"]
        if row[0] != "this plan"
    }


@pytest.mark.slow
def test_plan_pages_show_the_named_baselines_as_the_terminal_does(cli, tmp_path, small_gpt):
    saved = tmp_path / "plan.json"
    code, text, err = cli("plan", "--model", small_gpt, "--budget", "80%", "--save", str(saved))
    assert code == 0, err
    baselines = json.loads(saved.read_text())["baselines"]
    page = tmp_path / "plan.html"
    _report(cli, str(saved), "--html", str(page))
    shown = _baselines_on_the_page(
        _page_data(page.read_text()), "beside the plans people use", "peak bytes", "extra FLOPs"
    )
    assert sorted(shown) == sorted(b["label"] for b in baselines)
    drawn = 0
    for b in baselines:
        points, peak, flops = shown[b["label"]]
        assert (peak, flops) == ((b["peak_bytes"], b["extra_flops"]) if b["peak_bytes"] is not None else (None, None))
        if b["peak_bytes"] is None:  # not expressible on this model (the GPT's unfused attention: Megatron's)
            assert points is None and b["note"]
            continue
        assert [(p["peak_bytes"], p["extra_flops"], p["extra_other_flops"]) for p in points] == [
            (b["peak_bytes"], b["extra_flops"], b["extra_other_flops"])
        ]
        row = _terminal_row(text, b["label"])
        assert f"{b['peak_bytes']:,}" in row and f"{b['extra_flops']:,}" in row, row
        drawn += 1
    assert drawn == 3  # no recomputation, full per block, op-level SAC


@pytest.mark.slow
def test_pareto_pages_show_the_named_baselines_as_the_terminal_does():
    from trainledger.commands import pareto as pareto_cmd
    from trainledger.examples import gpt_tiny as build
    from trainledger.remat import pareto
    from trainledger.report.saved import Saved

    result = pareto(build(n_layer=2, seq_len=32), num_budgets=2, cost="flops")
    text = _rendered(pareto_cmd.render, result)
    data = _page_data(html_page(Saved("pareto", result, ())))
    shown = _baselines_on_the_page(data, "named baselines", "peak", "its extra FLOPs")
    assert sorted(shown) == sorted(b.label for b in result.baselines)
    drawn = 0
    for b, ours in zip(result.baselines, result.at_baselines, strict=True):
        points, peak, cost = shown[b.label]
        if b.peak_bytes is None:
            assert (points, peak, cost) == (None, None, None)
            continue
        assert (peak, cost) == (b.peak_bytes, b.cost_flops)
        assert [(p["peak_bytes"], p["extra_flops"] + p["extra_other_flops"]) for p in points] == [(peak, cost)]
        row = _terminal_row(text, b.label)
        assert f"{b.peak_bytes:,}" in row and f"{b.cost_flops:,}" in row and f"{ours.peak_bytes:,}" in row, row
        drawn += 1
    assert drawn == 3


def test_every_kind_gets_a_page(cli, tmp_path, rank_folder):
    for name in ("state-model", "estimate", "fit", "shard-params-all", "trace-sharded"):
        path, original, _ = _saved(cli, tmp_path, f"{name}.json", *DETERMINISTIC[name])
        out = tmp_path / f"{name}.html"
        _report(cli, str(path), "--html", str(out))
        data = _page_data(out.read_text())
        top = original["traced"] if "traced" in original else original
        assert data["summary"]["peak"]["bytes"] == top["peak"]["bytes"], name
    folder, ranks = rank_folder
    out = tmp_path / "ranks.html"
    _report(cli, str(folder), "--html", str(out))
    data = _page_data(out.read_text())
    assert [b["bytes"] for b in data["bars"][0]["items"]] == [led.peak().bytes for led in ranks]
    assert data["summary"]["peak"]["bytes"] == max(led.peak().bytes for led in ranks)


# --- the page, drawn by a headless Chromium ------------------------------------------------------------------

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium installed (Debian: apt-get install -y chromium; .ci/run installs it)"
)
_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--enable-logging=stderr",
    "--v=0",
)


def _chromium(tmp_path: Path, url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / "chromium-profile"
    profile.mkdir(exist_ok=True)
    return subprocess.run(
        [CHROMIUM, *_FLAGS, f"--user-data-dir={profile}", *extra, url],
        capture_output=True,
        text=True,
        timeout=180,
    )


def _dump_dom(tmp_path: Path, page: Path, fragment: str = "", *extra: str) -> str:
    """The page's DOM once its script has run (``extra``: more of Chromium's flags for the same load, such as a
    screenshot), asserting that it reported no error."""
    run = _chromium(tmp_path, page.as_uri() + fragment, "--dump-dom", *extra)
    assert run.returncode == 0, run.stderr[-2000:]
    console = [line for line in run.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    dom = run.stdout
    status = re.search(r'<body[^>]*data-status="(\w+)"', dom)
    errors = re.search(r'<pre id="errors"[^>]*>(.*?)</pre>', dom, re.S)
    assert status is not None and status.group(1) == "ok", errors.group(1) if errors else dom[:2000]
    return dom


def _png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """Width, height and RGB(A) rows of an 8-bit PNG (colour type 2 or 6), decoded with zlib and struct."""
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(raw):
        (length,) = struct.unpack(">I", raw[pos : pos + 4])
        kind, body = raw[pos + 4 : pos + 8], raw[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert header is not None
    width, height, depth, colour = header[:4]
    assert depth == 8 and colour in (2, 6), header
    bpp = 3 if colour == 2 else 4
    data, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        kind, line = data[y * (stride + 1)], bytearray(data[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        line = _unfiltered(kind, line, prev, bpp)
        if bpp == 4:
            rgb = bytearray(line)
            del rgb[3::4]  # the alpha bytes
            rows.append(bytes(rgb))
        else:
            rows.append(bytes(line))
        prev = line
    return width, height, rows


def _unfiltered(kind: int, line: bytearray, prev: bytearray, bpp: int) -> bytearray:
    """A scanline with its PNG filter undone: each byte plus its predictor from ``a`` (the byte one pixel to the
    left, 0 at the left edge), ``b`` (above) and ``c`` (above and to the left)."""
    if kind == 0:
        return line
    if kind == 2:  # Up: b alone, no byte of the row depends on another
        return bytearray((x + b) & 255 for x, b in zip(line, prev, strict=True))
    if kind == 1:  # Sub: a
        for i in range(bpp, len(line)):
            line[i] = (line[i] + line[i - bpp]) & 255
    elif kind == 3:  # Average: (a + b) // 2
        for i in range(len(line)):
            line[i] = (line[i] + ((line[i - bpp] if i >= bpp else 0) + prev[i]) // 2) & 255
    elif kind == 4:  # Paeth: whichever of a, b, c is nearest p = a + b - c (so p - a = b - c, ...)
        for i in range(bpp):  # a = c = 0 at the left edge: p = b, which b is nearest
            line[i] = (line[i] + prev[i]) & 255
        for i in range(bpp, len(line)):
            a, b, c = line[i - bpp], prev[i], prev[i - bpp]
            pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
            line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    else:
        raise AssertionError(f"PNG filter type {kind}")
    return line


def _colours(rows: list[bytes]) -> dict[bytes, int]:
    counts: dict[bytes, int] = {}
    for row in rows:
        for i in range(0, len(row), 3):
            px = row[i : i + 3]
            counts[px] = counts.get(px, 0) + 1
    return counts


@needs_chromium
def test_page_in_a_headless_browser(tmp_path, traced):
    page = write_html(traced, tmp_path / "step.html")
    shot = tmp_path / "step.png"  # drawn by the same load of the page
    dom = _dump_dom(tmp_path, page, "", f"--screenshot={shot}", "--window-size=1280,1100")
    peak = traced.peak()
    m = re.search(r'id="peak-bytes" data-bytes="(\d+)">([^<]*)<', dom)
    assert m is not None and int(m.group(1)) == peak.bytes and m.group(2) == f"{peak.bytes:,} bytes"
    assert f"peak {peak.bytes:,} bytes" in dom  # marked on the timeline
    assert 'id="timeline-chart"' in dom and 'id="entries-table"' in dom
    # at load, the instant shown is the peak: its live set is the ledger's, largest first
    total = re.search(r'id="instant-total" data-bytes="(\d+)"', dom)
    assert total is not None and int(total.group(1)) == peak.bytes
    assert f"{len(traced.live_at(peak.event)):,} arrays live at event {peak.event:,}" in dom

    assert shot.exists()
    width, height, rows = _png_pixels(shot)
    assert (width, height) == (1280, 1100)
    colours = _colours(rows)
    assert len(colours) > 50, "a blank page"
    # the stacked areas are drawn in the categories' colours, filling many pixels
    for cat in ("weights", "optimizer", "activations"):
        rgb = bytes.fromhex(CATEGORY_COLORS[cat].lstrip("#"))
        assert colours.get(rgb, 0) > 2000, (cat, colours.get(rgb, 0))


@needs_chromium
def test_any_instant_by_link(tmp_path, traced):
    """``page.html#event=N`` shows instant N: the arrays live then, computed in the page, are the ledger's."""
    page = write_html(traced, tmp_path / "step.html")
    event = 700  # in backward, after the peak
    dom = _dump_dom(tmp_path, page, f"#event={event}")
    live = traced.live_at(event)
    total = re.search(r'id="instant-total" data-bytes="(\d+)"', dom)
    assert total is not None and int(total.group(1)) == sum(e.nbytes for e in live)
    assert f"{len(live):,} arrays live at event {event:,}, largest first" in dom
    table = re.search(r'<table id="live-table">.*?<tbody>(.*?)</tbody>', dom, re.S)
    assert table is not None
    shown = re.findall(r"<tr><td[^>]*>([^<]*)</td>", table.group(1))
    largest = sorted(live, key=lambda e: (-e.nbytes, e.name))
    assert shown == [e.name for e in largest[: len(shown)]] and len(shown) == min(len(live), 200)


def _big_ledger(num_entries: int = 6000, num_events: int = 11000) -> Ledger:
    """A ledger the size of a 7B fake trace (~6k storages, ~11k events), every lifetime different."""
    phases = ["forward"] * 4000 + ["backward"] * 5000 + ["optimizer"] * 1999 + ["zero_grad"]
    events = tuple(Event(i, phases[i], f"aten.op{i % 40}", f"model.layers.{i % 32}") for i in range(num_events))
    cats = list(Category)
    entries = []
    for i in range(num_entries):
        start = (i * 7919) % num_events
        persistent = i % 10 == 0
        entries.append(
            Entry(
                f"t{i}",
                cats[i % len(cats)],
                "saved",
                "bfloat16",
                1 << (10 + i % 12),
                1 << (11 + i % 12),
                owner=f"model.layers.{i % 32}",
                alloc_event=None if persistent else start,
                free_event=None if persistent else min(num_events, start + 1 + (i * 31) % 3000),
                evidence=Evidence.TRACED,
                shape=(1 << (i % 12), 1024),
            )
        )
    return Ledger(tuple(entries), events, evidence=Evidence.TRACED)


@needs_chromium
def test_a_ledger_of_a_7b_trace_stays_responsive(tmp_path):
    led = _big_ledger()
    page = write_html(led, tmp_path / "big.html")
    assert page.stat().st_size < 2_000_000
    dom = _dump_dom(tmp_path, page)
    assert re.search(r'id="peak-bytes" data-bytes="(\d+)"', dom).group(1) == str(led.peak().bytes)
    ms = int(re.search(r'data-render-ms="(\d+)"', dom).group(1))
    assert ms < 5000, f"the page took {ms} ms to draw"
    # the drawing is downsampled (one column per pixel), not one path point per event
    paths = re.findall(r'<path d="M[^"]*"', dom)
    assert paths and max(p.count("H") for p in paths) < 2 * 1280


@needs_chromium
@pytest.mark.slow
def test_every_kind_renders_in_a_browser(cli, tmp_path, rank_folder, small_gpt):
    targets = {}
    for name in ("state-model", "estimate", "fit", "shard-params-all", "trace-sharded"):
        path, original, _ = _saved(cli, tmp_path, f"{name}.json", *DETERMINISTIC[name])
        targets[name] = (path, (original.get("traced") or original)["peak"]["bytes"])
    path, original, _ = _saved(cli, tmp_path, "plan.json", "plan", "--model", small_gpt, "--budget", "80%")
    targets["plan"] = (path, original["peak"]["bytes"])
    path, original, _ = _saved(cli, tmp_path, "pareto.json", "pareto", "--model", small_gpt, "--budgets", "3")
    targets["pareto"] = (path, original["peak"]["bytes"])
    folder, ranks = rank_folder
    targets["ranks"] = (folder, max(led.peak().bytes for led in ranks))
    for name, (path, peak) in targets.items():
        page = tmp_path / f"{name}.html"
        _report(cli, str(path), "--html", str(page))
        dom = _dump_dom(tmp_path, page)
        m = re.search(r'id="peak-bytes" data-bytes="(\d+)"', dom)
        assert m is not None and int(m.group(1)) == peak, name
        if name in ("plan", "pareto"):  # each baseline the model can express is a marker on the drawn chart
            chart = re.search(r'<svg[^>]*id="pareto-chart".*?</svg>', dom, re.S)
            assert chart is not None, name
            labels = [b["label"] for b in json.loads(path.read_text())["baselines"] if b["peak_bytes"] is not None]
            titles = re.findall(r"<title>([^<]*)</title>", chart.group(0))
            assert len(labels) == 3 and all(any(t.startswith(label + ": peak") for t in titles) for label in labels)
