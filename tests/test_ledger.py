"""The ledger's arithmetic, against hand calculations."""

from __future__ import annotations

from fractions import Fraction

import pytest

from trainledger.ledger import Category, Entry, Event, Evidence, Ledger

W = Category.WEIGHTS
A = Category.ACTIVATIONS
G = Category.GRADIENTS
S = Category.WORKSPACE


def _ledger() -> Ledger:
    # weights live throughout; activation a lives 0..2; workspace t lives only at 3; gradient from 3 on.
    entries = (
        Entry("w", W, "param", "float32", 100, 400),
        Entry("a", A, "saved", "float32", 50, 200, alloc_event=0, free_event=3),
        Entry("t", S, "temp", "float32", 75, 300, alloc_event=3, free_event=4),
        Entry("g", G, "grad", "float32", 100, 400, alloc_event=3, free_event=5),
    )
    events = tuple(Event(i, ph, f"op{i}") for i, ph in enumerate(["forward"] * 2 + ["backward"] * 3))
    return Ledger(entries, events, evidence=Evidence.TRACED)


def test_live_bytes_and_timeline_by_hand():
    led = _ledger()
    assert [led.live_bytes(i) for i in range(5)] == [600, 600, 600, 1100, 800]
    tl = led.timeline()
    assert tl["activations"] == [200, 200, 200, 0, 0]
    assert tl["workspace"] == [0, 0, 0, 300, 0]
    assert led.totals() == [600, 600, 600, 1100, 800]


def test_peak_is_taken_at_one_instant():
    pk = _ledger().peak()
    assert (pk.bytes, pk.event, pk.phase, pk.op) == (1100, 3, "backward", "op3")
    assert pk.by_category == {"weights": 400, "workspace": 300, "gradients": 400}  # no activations at event 3


def test_sum_of_category_maxima_overstates():
    led = _ledger()
    assert led.category_maxima() == {"weights": 400, "activations": 200, "workspace": 300, "gradients": 400}
    assert led.sum_of_category_maxima() == 1300 > led.peak().bytes == 1100


def test_peak_ties_take_the_first_event():
    e = (
        Entry("x", S, "t", "float32", 1, 4, alloc_event=1, free_event=2),
        Entry("y", S, "t", "float32", 1, 4, alloc_event=3, free_event=4),
    )
    led = Ledger(e, tuple(Event(i, "forward") for i in range(4)))
    assert led.peak().event == 1


def test_payload_is_the_seeds_formula():
    P = 423
    entries = (
        Entry("w", W, "param", "float64", P, 8 * P),
        Entry("m", Category.OPTIMIZER, "exp_avg", "float64", P, 8 * P),
        Entry("v", Category.OPTIMIZER, "exp_avg_sq", "float64", P, 8 * P),
        Entry("s", Category.OPTIMIZER, "step", "float32", 1, 4),
        Entry("g", G, "grad", "float64", P, 8 * P),
    )
    pay = Ledger(entries).payload()
    assert pay.num_params == P
    assert [r.bytes_per_param for r in pay.rows] == [Fraction(8)] * 4
    assert [t for _, t in pay.running_totals()] == [3384, 6768, 10152, 13536]
    assert pay.bytes == P * 32
    assert pay.excluded == ("optimizer:step",)


def test_payload_with_mixed_precision_is_fractional_but_exact():
    entries = (
        Entry("w1", W, "param", "bfloat16", 3, 6),
        Entry("w2", W, "param", "float32", 1, 4),
        Entry("g", G, "grad", "float32", 4, 16),
    )
    pay = Ledger(entries).payload()
    assert pay.rows[0].bytes_per_param == Fraction(10, 4)
    assert pay.bytes == 26


def test_json_round_trip():
    led = _ledger()
    back = Ledger.from_dict(led.to_dict())
    assert back.entries == led.entries and back.events == led.events
    d = led.to_dict()
    for key in ("schema", "evidence", "device", "peak", "category_maxima", "sum_of_category_maxima"):
        assert key in d
    assert set(d["peak"]) >= {"bytes", "event", "phase", "by_category"}


def test_bad_intervals_are_rejected():
    with pytest.raises(ValueError, match="clock has 1"):
        Ledger((Entry("x", S, "t", "float32", 1, 4, alloc_event=5),))
    with pytest.raises(ValueError, match="unknown ledger schema"):
        Ledger.from_dict({"schema": "nope"})


def test_ledger_module_imports_no_torch():
    import subprocess
    import sys

    import trainledger

    # Load the torch-free modules without the package __init__ (which re-exports torch-backed code).
    src = trainledger.__path__[0]
    probe = (
        "import sys, types\n"
        f"pkg = types.ModuleType('trainledger'); pkg.__path__ = [{src!r}]; sys.modules['trainledger'] = pkg\n"
        "import trainledger.ledger, trainledger.units, trainledger.declared\n"
        "import trainledger.allocator, trainledger.devices\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
