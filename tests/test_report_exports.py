"""Pictures and exports of a ledger, checked against hand calculations and against torch's own readers.

The memory_viz snapshot is read back by ``torch.cuda._memory_viz`` (``segsum``, ``memory``, ``trace``,
``filter_alloc_free_pairs``, ``trace_plot``, ``segment_plot`` and its command line), and replayed the way
the viewer's ``process_alloc_data`` (torch/utils/viz) replays it: the bytes it shows at every event must
be the ledger's, exactly.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import importlib.util
import io
import json
import os
import pickle
import pickletools
import re
import runpy
import struct
import sys
import warnings
import xml.etree.ElementTree as ET

import pytest

from tests.conftest import traced_example
from trainledger.errors import InputError
from trainledger.ledger import Category, Entry, Event, Evidence, Ledger
from trainledger.report.exports import (
    ALIGN_BYTES,
    check_export_paths,
    event_times_us,
    to_memory_viz_snapshot,
    to_perfetto,
    write_exports,
    write_ledger_json,
    write_memory_viz,
    write_perfetto,
)

C = Category

# --- a multi-phase ledger whose every number is worked out by hand ----------------------------------------

_EVENTS = [
    ("forward", "aten.embedding", "wte"),
    ("forward", "aten.mm", "blocks.0.mlp.fc"),
    ("forward", "aten.gelu", "blocks.0.mlp"),
    ("forward", "aten.nll_loss", "(root)"),
    ("backward", "aten.nll_loss_backward", "(root)"),
    ("backward", "aten.gelu_backward", "blocks.0.mlp"),
    ("backward", "aten.mm", "blocks.0.mlp.fc"),
    ("backward", "aten.embedding_dense_backward", "wte"),
    ("optimizer", "aten._foreach_mul_", ""),
    ("optimizer", "aten._foreach_add_", ""),
    ("zero_grad", "", ""),
]


def hand_ledger(**meta) -> Ledger:
    def e(name, cat, nbytes, alloc=None, free=None, role="x"):
        return Entry(name, cat, role, "float32", nbytes // 4, nbytes, alloc_event=alloc, free_event=free)

    entries = (
        e("w", C.WEIGHTS, 4096, role="param"),
        e("f", C.FROZEN, 1000, role="param"),  # not a multiple of the 512-byte alignment
        e("m", C.OPTIMIZER, 4096, role="exp_avg"),
        e("x", C.INPUTS, 2048, None, 4, role="batch"),  # existed before the step, dropped in backward
        e("a1", C.ACTIVATIONS, 8192, 1, 6, role="saved"),
        e("a2", C.ACTIVATIONS, 16384, 2, 5, role="saved"),
        e("t", C.WORKSPACE, 3000, 3, 4),
        e("t2", C.WORKSPACE, 512, 6, 7),
        e("g1", C.GRADIENTS, 4096, 5, 10, role="grad"),  # freed by zero_grad
        e("g2", C.GRADIENTS, 100, 7, None, role="grad"),  # outlives the step
        e("s", C.OPTIMIZER, 8, 8, 11, role="step"),  # freed after the last event
        e("z", C.WORKSPACE, 0, 3, 4),  # zero bytes: no allocation
        e("never", C.WORKSPACE, 777, 9, 9),  # never live on the clock
    )
    events = tuple(Event(i, ph, op, mod) for i, (ph, op, mod) in enumerate(_EVENTS))
    return Ledger(entries, events, evidence=Evidence.TRACED, meta={"model": "hand", **meta})


# Live bytes at each event, added up by hand: persistent w + f + m = 9192.
HAND_TOTALS = [11240, 19432, 35816, 38816, 33768, 21480, 13800, 13388, 13396, 13396, 9300]
HAND_PEAK = 38816  # event 3: persistent 9192 + x 2048 + a1 8192 + a2 16384 + t 3000
HAND_AFTER_STEP = 9292  # w + f + m + g2
HAND_NUM_ALLOCS = 11  # every entry but z (0 bytes) and "never"
HAND_NUM_FREES = 7  # x, a1, a2, t, t2, g1, s


def test_hand_ledger_is_what_the_hand_says():
    led = hand_ledger()
    assert led.totals() == HAND_TOTALS
    assert (led.peak().bytes, led.peak().event) == (HAND_PEAK, 3)


# --- the viewer's replay -----------------------------------------------------------------------------


def viewer_replay(snapshot: dict, device: int = 0) -> tuple[int, list[tuple[float, int]]]:
    """Bytes the viewer shows: initial bytes, then (time_us, bytes) after every alloc/free it plots.

    The rules of ``process_alloc_data`` in torch/utils/viz (the non-pool path): an ``alloc`` starts an
    element; a ``free_completed`` at an address with an open alloc ends it, one without is an element that
    existed before the trace; an ``active_allocated`` block of ``segments`` at an address with no open
    alloc at the end of the trace existed before and outlives it.
    """
    trace = snapshot["device_traces"][device]
    open_allocs: dict[int, int] = {}
    initial = 0
    for t in trace:
        if t["action"] == "alloc":
            open_allocs[t["addr"]] = t["size"]
        elif t["action"] == "free_completed":
            if open_allocs.pop(t["addr"], None) is None:
                initial += t["size"]
    for seg in snapshot["segments"]:
        if seg["device"] != device:
            continue
        for b in seg["blocks"]:
            if b["state"] == "active_allocated" and b["address"] not in open_allocs:
                initial += b["requested_size"]
    live, steps, seen = initial, [], set()
    for t in trace:
        if t["action"] == "alloc":
            live += t["size"]
            seen.add(t["addr"])
        elif t["action"] == "free_completed":
            live -= t["size"]
            seen.discard(t["addr"])
        else:
            continue
        steps.append((t["time_us"], live))
    return initial, steps


def bytes_at_times(steps: list[tuple[float, int]], initial: int, times: list[float]) -> list[int]:
    """The bytes shown at each time: after the last action stamped at or before it."""
    out, live, k = [], initial, 0
    for t in times:
        while k < len(steps) and steps[k][0] <= t:
            live = steps[k][1]
            k += 1
        out.append(live)
    return out


def test_snapshot_replays_to_the_ledger_totals_at_every_event():
    led = hand_ledger()
    snap = to_memory_viz_snapshot(led)
    initial, steps = viewer_replay(snap)
    assert initial == 0  # everything, weights included, is an allocation in the trace
    at = bytes_at_times(steps, initial, list(range(led.num_events + 1)))
    assert at[:-1] == HAND_TOTALS
    assert at[-1] == HAND_AFTER_STEP  # after the last event: what outlives the step
    assert max(live for _, live in steps) == HAND_PEAK == led.peak().bytes


def test_snapshot_actions_sizes_and_categories():
    snap = to_memory_viz_snapshot(hand_ledger())
    trace = snap["device_traces"][0]
    actions = [t["action"] for t in trace]
    assert actions.count("alloc") == HAND_NUM_ALLOCS
    assert actions.count("free_requested") == actions.count("free_completed") == HAND_NUM_FREES
    for t in trace:
        assert set(t) >= {"action", "addr", "size", "stream", "time_us", "frames"}
        for f in t["frames"]:
            assert set(f) == {"filename", "line", "name"}
    sizes = {t["frames"][0]["name"].split()[0]: t["size"] for t in trace if t["action"] == "alloc"}
    assert sizes == {
        "w": 4096,
        "f": 1000,
        "m": 4096,
        "x": 2048,
        "a1": 8192,
        "a2": 16384,
        "t": 3000,
        "t2": 512,
        "g1": 4096,
        "g2": 100,
        "s": 8,
    }
    # Pre-existing entries first, in the fixed category order, so the viewer's legend starts in that order.
    first = [t["category"] for t in trace[:4]]
    assert first == ["weights", "frozen", "optimizer", "inputs"]
    # The viewer fails unless "unknown" is among the categories it sees (annotate_snapshot).
    assert "unknown" in {t.get("category") for t in trace}
    # The alloc site names the op, module and phase.
    a1 = next(t for t in trace if t["action"] == "alloc" and t["frames"][0]["name"].startswith("a1 "))
    assert a1["frames"][1] == {"filename": "blocks.0.mlp.fc", "line": 1, "name": "aten.mm (forward)"}
    assert "activations/saved" in a1["frames"][0]["name"]


def test_live_blocks_never_overlap_and_are_aligned():
    snap = to_memory_viz_snapshot(hand_ledger())
    live: dict[int, int] = {}
    for t in snap["device_traces"][0]:
        if t["action"] == "alloc":
            assert t["addr"] % ALIGN_BYTES == 0
            for a, size in live.items():
                assert t["addr"] + t["size"] <= a or a + size <= t["addr"], "overlapping live blocks"
            live[t["addr"]] = t["size"]
        elif t["action"] == "free_completed":
            del live[t["addr"]]
    (seg,) = snap["segments"]
    assert {a: s for a, s in live.items()} == {
        b["address"]: b["size"] for b in seg["blocks"] if b["state"] == "active_allocated"
    }
    # The blocks tile the segment exactly (what segsum asserts).
    assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
    addrs = [b["address"] for b in seg["blocks"]]
    assert addrs[0] == seg["address"]
    assert all(b["address"] + b["size"] == nxt for b, nxt in zip(seg["blocks"], addrs[1:], strict=False))


# --- torch's own readers -----------------------------------------------------------------------------

mv = pytest.importorskip("torch.cuda._memory_viz")


def test_torch_segsum_and_calc_active_agree_with_the_ledger():
    snap = to_memory_viz_snapshot(hand_ledger())
    text = mv.segsum(copy.deepcopy(snap))  # raises if blocks do not add up to the segment
    (seg,) = snap["segments"]
    assert mv.calc_active(seg) == HAND_AFTER_STEP
    assert f"total_allocated: {mv.Bytes(HAND_AFTER_STEP)}" in text


def test_torch_memory_flamegraph_lines_add_up():
    snap = to_memory_viz_snapshot(hand_ledger())
    lines = mv.memory(snap, format_flamegraph=lambda s: s).splitlines()
    active = [ln for ln in lines if ";active_allocated;" in ln]
    assert sum(int(ln.rsplit(" ", 1)[1]) for ln in active) == HAND_AFTER_STEP
    assert any("g2 gradients/grad" in ln for ln in active)  # frames carry the entry's name


def test_torch_trace_printout_and_filter_freed():
    snap = to_memory_viz_snapshot(hand_ledger())
    n_trace = len(snap["device_traces"][0])
    text = mv.trace(copy.deepcopy(snap))
    assert text.startswith(f"Device 0 ----------------\n{n_trace} entries\n")
    assert len(re.findall(r"^del ", text, re.M)) == HAND_NUM_FREES
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        kept = mv.filter_alloc_free_pairs(copy.deepcopy(snap))
    assert out.getvalue() == ""  # it prints each free_completed without a free_requested
    left = [t for t in kept["device_traces"][0] if t["action"] == "alloc"]
    assert sum(t["size"] for t in left) == HAND_AFTER_STEP


# Opcodes that the viewer's own unpickler (``unpickle`` in torch/utils/viz/MemoryViz.js) understands.
_VIEWER_OPCODES = {
    "PROTO", "APPEND", "APPENDS", "LIST", "TUPLE", "NEWFALSE", "NEWTRUE", "NONE", "BINGET", "BININT",
    "BININT1", "BININT2", "EMPTY_DICT", "EMPTY_LIST", "FRAME", "LONG1", "LONG_BINGET", "MARK", "MEMOIZE",
    "BINPUT", "LONG_BINPUT", "SETITEMS", "SETITEM", "DICT", "SHORT_BINUNICODE", "BINUNICODE", "STOP",
    "EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "BINFLOAT",
}  # fmt: skip


def test_written_pickle_is_readable_by_the_viewer_and_torch(tmp_path, capsys, monkeypatch):
    led = hand_ledger()
    path = write_memory_viz(led, tmp_path / "step.pickle")
    raw = path.read_bytes()
    assert {op.name for op, _, _ in pickletools.genops(raw)} <= _VIEWER_OPCODES
    assert pickle.loads(raw) == to_memory_viz_snapshot(led)
    # The HTML pages torch builds embed the pickle for MemoryViz.js; it round-trips.
    for html in (mv.trace_plot(pickle.loads(raw)), mv.segment_plot(pickle.loads(raw))):
        payload = json.loads(re.search(r"const local_files = (\[.*?\])\n", html).group(1))[0]["base64"]
        assert pickle.loads(base64.b64decode(payload)) == to_memory_viz_snapshot(led)
    # And torch's command line reads the file as a user would run it (``python -m torch.cuda._memory_viz stats``;
    # its ``__main__`` block run here, not in a new process that imports torch again).
    monkeypatch.setattr(sys, "argv", ["_memory_viz.py", "stats", str(path)])
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is imported already (as ``mv``)
        runpy.run_module("torch.cuda._memory_viz", run_name="__main__")
    out, err = capsys.readouterr()
    assert f"total_allocated: {mv.Bytes(HAND_AFTER_STEP)}" in out, err


def test_snapshot_device_index_follows_the_ledger():
    led = hand_ledger()
    snap = to_memory_viz_snapshot(Ledger(led.entries, led.events, device="cuda:2"))
    assert [len(t) > 0 for t in snap["device_traces"]] == [False, False, True]
    assert snap["segments"][0]["device"] == 2
    assert viewer_replay(snap, device=2)[1][-1][1] == HAND_AFTER_STEP


def test_empty_ledger_snapshot():
    snap = to_memory_viz_snapshot(Ledger((), (Event(0, "state"),)))
    assert snap["segments"] == []
    assert [t["action"] for t in snap["device_traces"][0]] == ["snapshot"]


# --- Perfetto ------------------------------------------------------------------------------------------


def assert_well_nested(slices: list[dict]) -> None:
    stack: list[tuple[float, float]] = []
    for s in sorted(slices, key=lambda s: (s["ts"], -s["dur"])):
        start, end = s["ts"], s["ts"] + s["dur"]
        while stack and start >= stack[-1][1]:
            stack.pop()
        if stack:
            assert stack[-1][0] <= start and end <= stack[-1][1], f"{s['name']} crosses its parent"
        stack.append((start, end))


def test_perfetto_counters_slices_and_peak(tmp_path):
    led = hand_ledger()
    path = write_perfetto(led, tmp_path / "step.json")
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    ops = [e for e in slices if e["cat"] == "op"]
    assert [(e["ts"], e["dur"], e["name"]) for e in ops] == [
        (i, 1, op or "(no op)") for i, (_, op, _) in enumerate(_EVENTS)
    ]
    assert [e["args"]["live_bytes"] for e in ops] == HAND_TOTALS
    assert ops[3]["args"]["allocated_bytes"] == 3000 and ops[4]["args"]["freed_bytes"] == 2048 + 3000
    assert_well_nested(slices)
    phases = [(e["name"], e["ts"], e["dur"]) for e in slices if e["cat"] == "phase"]
    assert phases == [("forward", 0, 4), ("backward", 4, 4), ("optimizer", 8, 2), ("zero_grad", 10, 1)]
    modules = {(e["name"], e["ts"], e["dur"]) for e in slices if e["cat"] == "module"}
    assert ("blocks.0.mlp", 1, 2) in modules and ("blocks.0.mlp.fc", 1, 1) in modules  # forward: events 1-2
    assert ("blocks.0.mlp", 5, 2) in modules  # backward: events 5-6

    timeline = led.timeline()
    counters = {e["ts"]: e["args"] for e in events if e["ph"] == "C" and e["name"] == "live bytes"}
    totals = {e["ts"]: e["args"]["bytes"] for e in events if e["ph"] == "C" and e["name"] == "total live bytes"}
    present = [c for c, series in timeline.items() if any(series)]
    for i in range(led.num_events):
        assert counters[i] == {c: timeline[c][i] for c in present}
        assert totals[i] == HAND_TOTALS[i]
    assert totals[led.num_events] == HAND_AFTER_STEP
    (peak,) = [e for e in events if e["ph"] == "i"]
    assert peak["ts"] == 3 and peak["args"]["bytes"] == HAND_PEAK
    assert peak["name"] == "peak 37.91 KiB at aten.nll_loss in (root) (forward; cpu kernels)"
    assert data["otherData"]["peak"]["bytes"] == HAND_PEAK


def test_perfetto_uses_event_times_from_meta():
    starts = [0, 5, 7, 20, 21, 22, 30, 31, 40, 41, 50]
    led = hand_ledger(event_times_us=starts, event_durations_us=[3] * 11)
    ops = [e for e in to_perfetto(led)["traceEvents"] if e["ph"] == "X" and e["cat"] == "op"]
    assert [e["ts"] for e in ops] == starts
    # A duration longer than the gap to the next event is cut there, so slices stay nested.
    assert [e["dur"] for e in ops] == [3, 2, 3, 1, 1, 3, 1, 3, 1, 3, 3]
    assert_well_nested([e for e in to_perfetto(led)["traceEvents"] if e["ph"] == "X"])
    times = [t["time_us"] for t in to_memory_viz_snapshot(led)["device_traces"][0]]
    assert times[0] == 0 and times[-1] == 53 and times == sorted(times)


@pytest.mark.parametrize(
    ("meta", "fragment"),
    [
        ({"event_times_us": [0, 1]}, "list of 11 finite numbers"),
        ({"event_times_us": list(range(10, -1, -1))}, "non-decreasing"),
        ({"event_times_us": [0] * 10 + ["x"]}, "finite numbers"),
        ({"event_times_us": list(range(11)), "event_durations_us": [-1] * 11}, ">= 0"),
    ],
)
def test_bad_event_times_are_input_errors(meta, fragment):
    with pytest.raises(InputError, match=re.escape(fragment)):
        event_times_us(hand_ledger(**meta))


# --- ledger JSON -----------------------------------------------------------------------------------------


def test_ledger_json_round_trips(tmp_path):
    led = hand_ledger()
    path = write_ledger_json(led, tmp_path / "ledger.json")
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask  # the usual permissions, not a temp file's 0600
    assert [p.name for p in tmp_path.iterdir()] == ["ledger.json"]  # no temporary file left behind
    back = Ledger.from_dict(json.loads(path.read_text()))
    assert back.entries == led.entries and back.events == led.events
    assert back.totals() == HAND_TOTALS


# --- output paths ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("writer", "name", "fragment"),
    [
        (write_memory_viz, "out.json", "suffix '.json'; accepted: .pickle, .pkl"),
        (write_perfetto, "out.pickle", "suffix '.pickle'; accepted: .json"),
        (write_ledger_json, "out", "suffix '(none)'; accepted: .json"),
        (write_perfetto, "missing/out.json", "does not exist"),
    ],
)
def test_bad_output_paths(tmp_path, writer, name, fragment):
    with pytest.raises(InputError, match=re.escape(fragment)):
        writer(hand_ledger(), tmp_path / name)


def test_an_input_file_is_never_overwritten(tmp_path):
    given = tmp_path / "ledger.json"
    given.write_text("the user's file")
    with pytest.raises(InputError, match="one of the inputs"):
        write_ledger_json(hand_ledger(), given, protect=[given])
    assert given.read_text() == "the user's file"
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(InputError, match="is a folder"):
        write_perfetto(hand_ledger(), tmp_path / "dir.json")


def test_check_export_paths_then_write_exports(tmp_path):
    paths = check_export_paths(
        memory_viz=tmp_path / "s.pkl", perfetto=tmp_path / "t.json", ledger_json=tmp_path / "l.json"
    )
    written = write_exports(hand_ledger(), paths)
    assert written == {
        k: str(tmp_path / n) for k, n in [("memory_viz", "s.pkl"), ("perfetto", "t.json"), ("ledger_json", "l.json")]
    }
    assert Ledger.from_dict(json.loads((tmp_path / "l.json").read_text())).totals() == HAND_TOTALS
    assert pickle.loads((tmp_path / "s.pkl").read_bytes()) == to_memory_viz_snapshot(hand_ledger())


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (
            {"perfetto": "a.json", "ledger_json": "./a.json"},
            "ledger JSON path './a.json' is also the Perfetto trace path",
        ),
        ({"memory_viz": "a.json"}, "memory_viz snapshot path 'a.json' has suffix '.json'; accepted: .pickle, .pkl"),
        ({"plot": "a.pdf"}, "plot path 'a.pdf' has suffix '.pdf'; accepted: .png, .svg"),
        ({"ledger_json": "model.json", "protect": ["model.json"]}, "is one of the inputs"),
    ],
)
def test_bad_export_paths_are_caught_before_any_work(tmp_path, monkeypatch, kwargs, fragment):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match=re.escape(fragment)):
        check_export_paths(**kwargs)
    assert list(tmp_path.iterdir()) == []


def test_a_plot_without_matplotlib_is_refused_before_the_step(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(InputError, match=re.escape("pip install 'trainledger[plot]'")):
        check_export_paths(perfetto=tmp_path / "t.json", plot=tmp_path / "p.png")


# --- the picture -----------------------------------------------------------------------------------------

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="matplotlib is optional (trainledger[plot])"
)


def _png_size(raw: bytes) -> tuple[int, int]:
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR"
    return struct.unpack(">II", raw[16:24])


@needs_matplotlib
def test_plot_png_and_svg_are_valid(tmp_path):
    from trainledger.report.plot import plot_timeline

    png = plot_timeline(hand_ledger(), tmp_path / "step.png")
    assert _png_size(png.read_bytes()) == (12 * 120, 6 * 120)
    svg = plot_timeline(hand_ledger(), tmp_path / "step.SVG", title="a title")
    assert ET.parse(svg).getroot().tag == "{http://www.w3.org/2000/svg}svg"


@needs_matplotlib
def test_plot_content_matches_the_ledger():
    from matplotlib.colors import to_hex

    from trainledger.report.plot import CATEGORY_COLORS, timeline_figure

    led = hand_ledger()
    (ax,) = timeline_figure(led).axes
    assert ax.get_ylabel() == "live memory (KiB, 1 KiB = 2^10 bytes)"
    texts = [t.get_text() for t in ax.texts]
    assert "peak 37.91 KiB at aten.nll_loss in (root) (forward; cpu kernels)" in texts
    assert {"forward", "backward", "optimizer"} <= set(texts)
    handles, labels = ax.get_legend_handles_labels()
    present = [c.value for c in Category if any(led.timeline()[c.value])]
    assert labels[: len(present)] == present  # the fixed category order
    assert labels[-1] == "sum of category maxima\n(not simultaneous)"
    assert [to_hex(h.get_facecolor()[0]) for h in handles[: len(present)]] == [CATEGORY_COLORS[c] for c in present]
    (sum_line,) = [ln for ln in ax.get_lines() if ln.get_label().startswith("sum of")]
    assert sum_line.get_ydata()[0] == led.sum_of_category_maxima() / 1024
    # The top of the stack at each event is the ledger's total there.
    tops = ax.collections[-1].get_paths()[0].vertices[:, 1].max()
    assert tops == pytest.approx(HAND_PEAK / 1024)


@needs_matplotlib
def test_plot_rejects_other_suffixes_and_protects_inputs(tmp_path):
    from trainledger.report.plot import plot_timeline

    with pytest.raises(InputError, match=re.escape("suffix '.jpg'; accepted: .png, .svg")):
        plot_timeline(hand_ledger(), tmp_path / "step.jpg")
    given = tmp_path / "model.png"
    given.write_bytes(b"input")
    with pytest.raises(InputError, match="one of the inputs"):
        plot_timeline(hand_ledger(), given, protect=[given])
    assert given.read_bytes() == b"input"


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    from trainledger.report import plot

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    with pytest.raises(InputError, match=re.escape("pip install 'trainledger[plot]'")):
        plot.plot_timeline(hand_ledger(), tmp_path / "step.png")
    assert not (tmp_path / "step.png").exists()


@needs_matplotlib
def test_plot_of_an_untraced_ledger(tmp_path):
    from trainledger.report.plot import plot_timeline, timeline_figure

    w = Entry("w", C.WEIGHTS, "param", "bfloat16", 3 * 2**29, 3 * 2**30)
    path = plot_timeline(Ledger((w,)), tmp_path / "state.png")
    assert _png_size(path.read_bytes()) == (1440, 720)
    (ax,) = timeline_figure(Ledger((w,))).axes
    assert ax.get_ylabel() == "live memory (GiB, 1 GiB = 2^30 bytes)"
    texts = [t.get_text() for t in ax.texts]
    assert "total 3.00 GiB (inventoried state; not a peak: activations and workspace need a trace)" in texts
    assert ax.get_title(loc="left") == "training state (evidence: inventoried, cpu)"
    analytic = Ledger((w,), (Event(0, "forward"), Event(1, "backward")), evidence=Evidence.ANALYTIC)
    analytic_texts = [t.get_text() for t in timeline_figure(analytic).axes[0].texts]
    assert "estimated peak 3.00 GiB (forward; analytic, cpu kernels)" in analytic_texts
    # An empty ledger still draws (no legend, nothing stacked) instead of failing.
    assert _png_size(plot_timeline(Ledger(()), tmp_path / "empty.png").read_bytes()) == (1440, 720)


# --- a real traced step, and a large ledger ----------------------------------------------------------------


@pytest.mark.slow
@needs_matplotlib
def test_traced_gpt_tiny_exports_agree_with_its_ledger(tmp_path):
    from trainledger.report.plot import plot_timeline

    led = traced_example("gpt-tiny")
    snap = to_memory_viz_snapshot(led)
    initial, steps = viewer_replay(snap)
    assert bytes_at_times(steps, initial, list(range(led.num_events))) == led.totals()
    assert max(live for _, live in steps) == led.peak().bytes
    (seg,) = snap["segments"]
    assert mv.calc_active(seg) == sum(e.nbytes for e in led.entries if e.free_event is None)
    perf = to_perfetto(led)
    assert_well_nested([e for e in perf["traceEvents"] if e["ph"] == "X"])
    assert sum(1 for e in perf["traceEvents"] if e["ph"] == "X" and e["cat"] == "op") == led.num_events
    assert _png_size(plot_timeline(led, tmp_path / "gpt.png").read_bytes()) == (1440, 720)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["seed-423", "lstm", "lora", "bf16-master"])
def test_every_small_example_exports_exactly(name):
    trace = pytest.importorskip("trainledger.trace")
    from trainledger.examples import build

    led = trace.trace(build(name))
    initial, steps = viewer_replay(to_memory_viz_snapshot(led))
    assert bytes_at_times(steps, initial, list(range(led.num_events))) == led.totals()
    perf = to_perfetto(led)["traceEvents"]
    assert [e["args"]["bytes"] for e in perf if e["ph"] == "C" and e["name"] == "total live bytes"][:-1] == led.totals()
    assert_well_nested([e for e in perf if e["ph"] == "X"])


def large_ledger(num_events: int = 4000, num_entries: int = 30000) -> Ledger:
    """A deterministic ledger of the size a real trace has: many short temporaries, some long-lived ones."""
    phases = ["forward"] * (num_events * 2 // 5) + ["backward"] * (num_events * 2 // 5)
    phases += ["optimizer"] * (num_events - len(phases) - 1) + ["zero_grad"]
    events = tuple(Event(i, p, f"aten.op{i % 17}", f"layers.{(i // 50) % 12}.mlp") for i, p in enumerate(phases))
    entries, x = [], 12345
    cats = [C.ACTIVATIONS, C.WORKSPACE, C.WORKSPACE, C.GRADIENTS]
    for k in range(num_entries):
        x = (x * 1103515245 + 12345) % 2**31  # a small LCG: the same ledger on every machine
        start = x % num_events
        life = 1 + (x >> 8) % (400 if k % 5 == 0 else 6)
        stop = min(num_events, start + life)
        size = 512 * (1 + (x >> 4) % 64) + k % 3
        entries.append(Entry(f"t{k}", cats[k % 4], "x", "float32", size // 4, size, alloc_event=start, free_event=stop))
    for k in range(200):
        entries.append(Entry(f"p{k}", C.WEIGHTS, "param", "float32", 1024, 4096 + k))
    return Ledger(tuple(entries), events, evidence=Evidence.TRACED)


@pytest.mark.slow
def test_large_ledger_exports_stay_exact(tmp_path):
    led = large_ledger()
    snap = to_memory_viz_snapshot(led)
    initial, steps = viewer_replay(snap)
    assert bytes_at_times(steps, initial, list(range(led.num_events))) == led.totals()
    perf = to_perfetto(led)
    counters = [e["args"]["bytes"] for e in perf["traceEvents"] if e["ph"] == "C" and e["name"] == "total live bytes"]
    assert counters[:-1] == led.totals()
    assert_well_nested([e for e in perf["traceEvents"] if e["ph"] == "X"])
