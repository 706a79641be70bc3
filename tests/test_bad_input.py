"""Every bad input is one clean line: generated invalid invocations of every subcommand and of the public
Python functions.

For each command line: exit status 2, exactly one line on stderr (``trainledger <cmd>: error: ...``) that
names the bad value and says what would do, no traceback, well under 10 s, and no file written or changed
in the working folder (each runs in a fresh temporary folder, compared before and after). For each Python
call: :class:`trainledger.InputError` with a one-line message naming the bad value.

The invalid inputs fail before anything is traced, so hundreds of them run in well under a minute.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import string
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainledger
from trainledger.analytic import FAMILIES, RECIPES
from trainledger.checks import MAX_BUDGETS, MAX_LAYERS, MAX_PARAMS, MAX_SEQ_LEN
from trainledger.cli import build_parser, main
from trainledger.declared import OPTIMIZER_ARRAYS
from trainledger.errors import InputError
from trainledger.examples import EXAMPLES
from trainledger.remat import SOLVERS
from trainledger.shard import STRATEGIES
from trainledger.units import parse_count, parse_dtype, parse_size

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
LLAMA = str(FIXTURES / "llama-small.json")
GOOD_CONFIG = json.loads(Path(LLAMA).read_text())
HINTS = (
    "accepted",
    "choose from",
    "give",
    "must",
    "at most",
    "at least",
    "use ",
    "drop",
    "add ",
    "e.g.",
    "pick",
    "fix",
)
"""Words by which a message says what would do instead."""

# --- values -----------------------------------------------------------------------------------------

WORD = st.text(alphabet=string.ascii_letters + string.digits + "._+", min_size=1, max_size=12)
"""Names without spaces, quotes or a leading dash (those are argparse's business, tested apart)."""


def _fails(parse: Callable[[str], Any], text: str) -> bool:
    try:
        parse(text)
    except InputError:
        return True
    return False


def _formats(n: int) -> tuple[str, ...]:
    """How a message may print a bad number: as typed or with thousands separators."""
    return (str(n), f"{n:,}")


BAD_COUNT = st.one_of(
    st.integers(max_value=0).map(str),
    st.sampled_from(["lots", "1.5", "1e-3", "7Q", "nan", "inf", "0x10", "1e999", "½"]),
    WORD.filter(lambda t: _fails(parse_count, t)),
)
BAD_SIZE = st.one_of(
    st.sampled_from(["lots", "-1GB", "0", "12XB", "1e30", "1e19", "0.1", "nan", "1EiB"]),
    st.integers(min_value=2**60 + 1, max_value=10**40).map(str),
    WORD.filter(lambda t: _fails(parse_size, t)),
)
BAD_DTYPE = WORD.filter(lambda t: _fails(parse_dtype, t))
BAD_MODEL = WORD.filter(lambda t: t not in EXAMPLES and ":" not in t)
BAD_STAGE = WORD.filter(lambda t: t.strip().lower().replace("-", "_") not in {*"0123", *STRATEGIES, "all"})
BAD_WHOLE = st.one_of(
    st.integers(max_value=0).map(str), st.sampled_from(["two", "1.5", "1e-2", "0x4", "nan"]), WORD.filter(str.isalpha)
)
HUGE_PARAMS = st.integers(min_value=MAX_PARAMS.value + 1, max_value=10**40)
BAD_CONFIG_VALUE = st.one_of(
    st.integers(max_value=0),
    st.integers(min_value=2**22 + 1, max_value=2**62),
    st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: f != int(f)),
    st.booleans(),
    WORD,
    st.lists(st.integers(), max_size=2),
)
HUGE_CONFIG = {**GOOD_CONFIG, "hidden_size": 2**16, "intermediate_size": 2**18, "num_hidden_layers": 128}
"""About 10^13 parameters: plausible in a config, far beyond any machine's memory when built for real."""
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _bad_micro_batches(text: str) -> bool:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        return True
    return not sizes or min(sizes) < 1


# --- invalid invocations ----------------------------------------------------------------------------

Case = tuple[list[str], tuple[str, ...], dict[str, str]]
"""argv, the renderings of the bad value (one must be in the message), files to create first."""


def case(argv: list[str], *bad: str, files: dict[str, str] | None = None) -> Case:
    return argv, bad, files or {}


CASES = st.one_of(
    # demo takes no flags
    WORD.filter(lambda w: not "help".startswith(w)).map(lambda w: case(["demo", f"--{w}"], f"--{w}")),
    # state
    BAD_COUNT.map(lambda t: case(["state", f"--params={t}"], t)),
    HUGE_PARAMS.map(lambda n: case(["state", f"--params={n}"], *_formats(n))),
    BAD_COUNT.filter(lambda t: _fails(partial(parse_count, zero=True), t)).map(  # 0 frozen: the default
        lambda t: case(["state", "--params", "1e9", f"--frozen-params={t}"], t)
    ),
    BAD_DTYPE.map(lambda t: case(["state", "--params", "1e9", f"--weights={t}"], t)),
    BAD_DTYPE.map(lambda t: case(["state", "--params", "1e9", f"--master={t}"], t)),
    WORD.filter(lambda t: t.lower() not in (*OPTIMIZER_ARRAYS, "adafactor")).map(
        lambda t: case(["state", "--params", "1e9", f"--optimizer={t}"], t)
    ),
    BAD_MODEL.map(lambda t: case(["state", f"--model={t}"], t)),
    WORD.map(lambda t: case(["state", f"--model=missing_{t}.py:make"], f"missing_{t}.py")),
    st.sampled_from(["--weights", "--moments", "--master"]).map(
        lambda f: case(["state", "--model", "mlp", f, "fp32"], f)
    ),
    st.just(case(["state", "--params", "1e9", "--no-step"], "--no-step")),
    st.just(case(["state", "--model", "mlp", "--params", "5"], "--model", "--params")),
    st.just(case(["state"], "--model")),
    st.sampled_from(["trace", "state", "plan"]).map(
        lambda c: case(
            [c, "--model", "coro.py:make", *(("--budget", "50%") if c == "plan" else ())],
            "returned coroutine",
            files={"coro.py": "async def make():\n    return 1\n"},
        )
    ),
    st.sampled_from(["sgd"]).map(
        lambda o: case(["state", "--params", "1e9", "--optimizer", o, "--moments", "bf16"], "--moments")
    ),
    st.sampled_from(["1,,2", "1,2,", ",4"]).map(
        lambda m: case(["fit", "--hf-config", LLAMA, "--device-memory", "2GiB", "--micro-batches", m], m)
    ),
    # user model files that are wrong in every way
    WORD.filter(str.isidentifier).map(
        lambda f: case(["state", f"--model=mine.py:{f}"], f, files={"mine.py": "X = 1\n"})
    ),
    st.sampled_from(["def make(:\n", "import no_such_module_here\n", "raise ValueError('nope')\n"]).map(
        lambda src: case(["state", "--model=broken.py:make"], "broken.py", files={"broken.py": src})
    ),
    st.sampled_from(["return 42", "return None", "raise RuntimeError('x')", "import sys; sys.exit(3)"]).map(
        lambda body: case(["state", "--model=bad.py:make"], "make()", files={"bad.py": f"def make():\n    {body}\n"})
    ),
    # trace
    BAD_MODEL.map(lambda t: case(["trace", f"--model={t}"], t)),
    st.sampled_from(["--seq-len", "--micro-batch", "--lora-rank"]).map(
        lambda f: case(["trace", "--model", "mlp", f, "4"], f)
    ),
    WORD.map(lambda w: case(["trace", "--model", "mlp", f"--plot={w}.gif"], f"{w}.gif")),
    WORD.map(lambda w: case(["trace", "--model", "mlp", f"--export-json=no_dir_{w}/x.json"], f"no_dir_{w}")),
    st.sampled_from(["/proc/x.json", "/sys/x.json"]).map(
        lambda p: case(["trace", "--model", "mlp", f"--export-perfetto={p}"], str(Path(p).parent))
    ),
    st.just(case(["trace", "--model", "mlp", "--export-json", "a.json", "--export-perfetto", "a.json"], "a.json")),
    st.just(case(["trace", "--model", "mlp", "--measure", "--fake"], "--measure")),
    st.just(case(["trace", "--model=m.json:make", "--export-json=m.json"], "m.json", files={"m.json": "X=1\n"})),
    BAD_STAGE.map(lambda t: case(["trace", "--model", "mlp", f"--stage={t}"], t)),
    BAD_WHOLE.map(lambda t: case(["trace", "--model", "mlp", f"--world={t}"], t)),
    # shard
    BAD_WHOLE.map(lambda t: case(["shard", "--params", "1e9", f"--world={t}"], t)),
    BAD_STAGE.map(lambda t: case(["shard", "--params", "1e9", f"--stage={t}"], t)),
    st.sampled_from(["0", "-1", "nan", "inf", "fast"]).map(
        lambda t: case(["shard", "--params", "1e9", f"--link-gbps={t}"], t)
    ),
    WORD.filter(lambda t: t not in ("deepspeed", "torch")).map(
        lambda t: case(["shard", "--params", "1e9", f"--engine={t}"], t)
    ),
    st.integers(min_value=2, max_value=64).map(
        lambda n: case(["shard", "--params", "1e9", "--world", str(4 * n), "--nodes", str(n)], "--nodes")
    ),
    st.sampled_from(["--timeout=5", "--backend=gloo"]).map(
        lambda f: case(["shard", "--params", "1e9", f], f.split("=")[0])
    ),
    st.just(case(["shard", "--params", "1e9", "--run"], "--run")),
    st.integers(min_value=10**5, max_value=10**12).map(
        lambda n: case(["shard", "--model", "mlp", "--run", "--world", str(n)], str(n))
    ),
    # plan and pareto
    st.sampled_from(["lots", "-3%", "0%", "1e30", "1e19", "12XB", "%", "0"]).map(
        lambda b: case(["plan", "--model", "mlp", f"--budget={b}"], b)
    ),
    # a value that starts with a dash, given after a space: the value's own message, not argparse's
    st.sampled_from(["-3%", "-5", "-.5", "-1GB"]).map(lambda b: case(["plan", "--model", "mlp", "--budget", b], b)),
    st.sampled_from(["-2", "-0.5"]).map(lambda n: case(["shard", "--params", "1e9", "--world", n], n)),
    WORD.filter(lambda t: t not in SOLVERS).map(
        lambda t: case(["plan", "--model", "mlp", "--budget", "50%", f"--solver={t}"], t)
    ),
    WORD.map(lambda w: case(["plan", "--model", "mlp", "--budget", "50%", f"--save={w}.txt"], f"{w}.txt")),
    st.sampled_from(["/nonexistent/p.json", "/proc/p.json"]).map(
        lambda p: case(["plan", "--model", "mlp", "--budget", "50%", f"--save={p}"], str(Path(p).parent))
    ),
    BAD_MODEL.map(lambda t: case(["plan", f"--model={t}", "--budget", "50%"], t)),
    st.just(case(["plan", "--budget", "50%"], "--model")),
    st.integers(min_value=MAX_BUDGETS.value + 1, max_value=10**7).map(
        lambda n: case(["pareto", "--model", "mlp", "--budgets", str(n)], *_formats(n))
    ),
    BAD_WHOLE.map(lambda t: case(["pareto", "--model", "mlp", f"--budgets={t}"], t)),
    st.just(case(["pareto", "--model", "mlp", "--budgets", "1"], "at least 2")),  # said at once, not after 0
    WORD.filter(lambda t: t not in ("seconds", "flops")).map(
        lambda t: case(["pareto", "--model", "mlp", f"--cost={t}"], t)
    ),
    WORD.map(lambda w: case(["pareto", "--model", "mlp", f"--plot={w}.gif"], f"{w}.gif")),
    # report
    WORD.map(lambda w: case(["report", f"missing_{w}.json"], f"missing_{w}.json")),
    st.sampled_from(["{", "[1, 2]", "not json", '"text"', "", '{"schema": "other/1"}', '{"schema": 3}']).map(
        lambda text: case(["report", "saved.json"], "saved.json", files={"saved.json": text})
    ),
    WORD.map(
        lambda w: case(
            ["report", "saved.json", f"--html={w}.txt"], f"{w}.txt", files={"saved.json": json.dumps(GOOD_CONFIG)}
        )
    ),
    st.just(case(["report", "page.html", "--html=page.html"], "page.html", files={"page.html": "{}"})),
    # estimate and fit
    WORD.map(lambda w: case(["estimate", f"--hf-config=missing_{w}.json"], f"missing_{w}.json")),
    st.integers(min_value=MAX_SEQ_LEN.value + 1, max_value=10**15).map(
        lambda n: case(["estimate", "--hf-config", LLAMA, "--seq-len", str(n)], *_formats(n))
    ),
    st.integers(min_value=MAX_LAYERS.value + 1, max_value=10**12).map(
        lambda n: case(
            ["estimate", "--hf-config=deep.json"],
            *_formats(n),
            files={"deep.json": json.dumps({**GOOD_CONFIG, "num_hidden_layers": n})},
        )
    ),
    st.tuples(st.sampled_from(SIZE_KEYS), BAD_CONFIG_VALUE).map(
        lambda kv: case(
            ["estimate", "--hf-config=bad.json"], kv[0], files={"bad.json": json.dumps({**GOOD_CONFIG, kv[0]: kv[1]})}
        )
    ),
    WORD.filter(lambda t: t not in FAMILIES).map(
        lambda t: case(
            ["trace", "--hf-config=odd.json", "--fake"],
            t,
            files={"odd.json": json.dumps({**GOOD_CONFIG, "model_type": t})},
        )
    ),
    st.sampled_from(["{", "[1, 2]", "not json", '"text"', ""]).map(
        lambda text: case(["estimate", "--hf-config=config.json"], "config.json", files={"config.json": text})
    ),
    st.sampled_from(["--dtype", "--optimizer", "--attn", "--device-kind", "--remat"]).flatmap(
        lambda f: WORD.map(lambda t: case(["estimate", "--hf-config", LLAMA, f"{f}=x{t}"], f"x{t}"))
    ),
    st.just(case(["estimate", "--hf-config", LLAMA, "--sequence-parallel"], "sequence parallel")),
    st.just(case(["estimate", "--hf-config", LLAMA, "--remat-every", "2"], "--remat-every")),
    st.just(case(["estimate", "--hf-config", LLAMA, "--lora-targets", "q_proj"], "--lora-targets")),
    BAD_STAGE.map(lambda t: case(["estimate", "--hf-config", LLAMA, f"--stage={t}"], t)),
    BAD_SIZE.map(lambda t: case(["fit", "--hf-config", LLAMA, f"--device-memory={t}"], t)),
    st.just(case(["fit", "--hf-config", LLAMA], "--device-memory")),
    st.just(case(["fit", "--hf-config", LLAMA, "--device-memory", "80"], "80GiB or 80GB")),  # not 80 bytes
    st.just(case(["estimate", "--hf-config", LLAMA, "--stage", "3"], "give --world N")),  # one rank: nothing sharded
    st.sampled_from(["1e30", "9007199254740993"]).map(
        lambda t: case(["shard", "--params", "1e9", "--world", t], "most accepted")
    ),
    # a policy file named after a module would hide it from the training script beside it
    st.just(case(["plan", "--model", "gpt-tiny", "--budget", "60%", "--export-policy", "torch.py"], "hide that")),
    st.just(
        case(
            ["fit", "--hf-config", LLAMA, "--device-memory", "80GiB", "--dtype", "fp32", "--recipes", "bf16"], "--dtype"
        )
    ),
    st.just(case(["fit", "--hf-config", LLAMA, "--device-memory", "1GiB", "--reserve", "2GiB"], "reserve")),
    WORD.filter(lambda t: t not in RECIPES).map(
        lambda t: case(["fit", "--hf-config", LLAMA, "--device-memory", "80GiB", f"--recipes={t}"], t)
    ),
    WORD.filter(_bad_micro_batches).map(
        lambda t: case(["fit", "--hf-config", LLAMA, "--device-memory", "80GiB", f"--micro-batches={t}"], t)
    ),
)


@contextlib.contextmanager
def _in_fresh_folder(files: dict[str, str]) -> Iterator[Path]:
    """A temporary working folder holding ``files``; the previous folder is restored after."""
    here = Path.cwd()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name, text in files.items():
            (folder / name).write_text(text)
        os.chdir(folder)
        try:
            yield folder
        finally:
            os.chdir(here)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"/" for p in folder.rglob("*")}


def _run(argv: list[str]) -> tuple[int, str, float]:
    """The CLI in this process: (exit status, stderr, seconds)."""
    err, out = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own exits
            code = int(exc.code or 0)
    return code, err.getvalue(), time.perf_counter() - start


def _check_message(message: str, bad: tuple[str, ...]) -> None:
    assert "Traceback" not in message
    assert any(b in message for b in bad), f"the message names none of {bad}: {message}"
    assert any(h in message for h in HINTS), f"the message does not say what would do: {message}"


@settings(
    max_examples=240,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(CASES)
def test_every_bad_invocation_is_one_clean_line(c: Case) -> None:
    argv, bad, files = c
    with _in_fresh_folder(files) as folder:
        before = _snapshot(folder)
        code, err, seconds = _run(argv)
        after = _snapshot(folder)
    assert code == 2, f"{argv}: exit {code}: {err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"{argv}: {err}"
    assert lines[0].startswith(f"trainledger {argv[0]}: error: "), lines[0]
    _check_message(lines[0], bad)
    assert seconds < 10, f"{argv} took {seconds:.1f} s"
    assert after == before, f"{argv} wrote or changed files: {set(after) ^ set(before)}"


def test_every_subcommand_is_exercised():
    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices)
    argvs = [c[0][0] for c in _examples_of(CASES, 400)]
    assert set(sub.choices) <= set(argvs), set(sub.choices) - set(argvs)


def _examples_of(strategy: st.SearchStrategy[Any], n: int) -> list[Any]:
    found: list[Any] = []

    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(x: Any) -> None:
        found.append(x)

    collect()
    return found


# --- the public Python functions ---------------------------------------------------------------------


def _workload() -> trainledger.Workload:
    return trainledger.Workload(torch.nn.Linear(3, 1), torch.randn(4, 3), loss_fn=lambda o, b: o.sum())


NOT_A_WORKLOAD = st.one_of(
    st.none(),
    st.integers(),
    WORD,
    st.just(torch.nn.Linear),
    st.builds(lambda: torch.nn.Linear(2, 2)),
    st.builds(object),
)
NOT_A_MODULE = st.one_of(st.none(), st.integers(), WORD, st.just(torch.nn.Linear), st.builds(object))
NOT_CALLABLE = st.one_of(st.integers(), WORD, st.floats(allow_nan=False), st.lists(st.integers(), max_size=2))
BAD_INT = st.one_of(st.integers(max_value=0), WORD, st.floats(allow_nan=False), st.booleans(), st.none())
BAD_BUDGET = st.one_of(
    st.none(),
    st.floats(),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
    st.integers(max_value=0),
    st.sampled_from(["lots", "-5%", "1e30", "12XB"]),
)

Call = tuple[Callable[[], Any], tuple[str, ...]]


def call(fn: Callable[[], Any], *bad: str) -> Call:
    return fn, bad


def _shown(v: Any) -> tuple[str, ...]:
    """How a message may name a bad value: its repr, its type, or (a class) its name."""
    if isinstance(v, type):
        return (v.__name__,)
    text = repr(v)
    return (text[:40], type(v).__name__, *(_formats(v) if isinstance(v, int) and not isinstance(v, bool) else ()))


def _ledger() -> trainledger.Ledger:
    return trainledger.declared_ledger(trainledger.StateSpec(num_params=1000))


CALLS = st.one_of(
    NOT_A_MODULE.map(lambda v: call(lambda: trainledger.Workload(v, torch.randn(2)), *_shown(v))),
    NOT_CALLABLE.map(
        lambda v: call(lambda: trainledger.Workload(torch.nn.Linear(2, 1), torch.randn(2), optimizer=v), *_shown(v))
    ),
    NOT_CALLABLE.map(
        lambda v: call(lambda: trainledger.Workload(torch.nn.Linear(2, 1), torch.randn(2), loss_fn=v), *_shown(v))
    ),
    NOT_A_MODULE.filter(lambda v: v is not None).map(
        lambda v: call(lambda: trainledger.Workload(torch.nn.Linear(2, 1), torch.randn(2), reference=v), *_shown(v))
    ),
    st.one_of(WORD, st.integers()).map(
        lambda v: call(
            lambda: trainledger.Workload(torch.nn.Linear(2, 1), torch.randn(2), autocast_dtype=v), *_shown(v)
        )
    ),
    NOT_A_WORKLOAD.map(lambda v: call(lambda: trainledger.trace(v), *_shown(v))),
    NOT_A_WORKLOAD.map(lambda v: call(lambda: trainledger.workload_state(v), *_shown(v))),
    NOT_A_WORKLOAD.map(lambda v: call(lambda: trainledger.measure(v), *_shown(v))),
    NOT_A_WORKLOAD.map(lambda v: call(lambda: trainledger.run_step(v), *_shown(v))),
    NOT_A_WORKLOAD.map(lambda v: call(lambda: trainledger.plan(v, "50%"), *_shown(v))),
    NOT_A_WORKLOAD.map(lambda v: call(lambda: trainledger.pareto(v), *_shown(v))),
    BAD_BUDGET.map(lambda v: call(lambda: trainledger.plan(_workload(), v), *_shown(v))),
    BAD_INT.map(lambda v: call(lambda: trainledger.pareto(_workload(), num_budgets=v), *_shown(v))),
    st.integers(min_value=MAX_BUDGETS.value + 1).map(
        lambda v: call(lambda: trainledger.pareto(_workload(), num_budgets=v), *_formats(v))
    ),
    WORD.filter(lambda v: v not in SOLVERS).map(
        lambda v: call(lambda: trainledger.plan(_workload(), "50%", solver=v), v)
    ),
    NOT_A_WORKLOAD.map(lambda v: call(lambda: trainledger.shard(v, world_size=2), *_shown(v))),
    BAD_INT.map(lambda v: call(lambda: trainledger.shard(_ledger(), world_size=v), *_shown(v))),
    WORD.filter(lambda v: v not in STRATEGIES).map(
        lambda v: call(lambda: trainledger.shard(_ledger(), world_size=2, strategy=v), v)
    ),
    BAD_INT.map(lambda v: call(lambda: trainledger.ShardConfig(world_size=v), *_shown(v))),
    NOT_A_MODULE.map(lambda v: call(lambda: trainledger.inventory(v), *_shown(v))),
    NOT_A_WORKLOAD.map(lambda v: call(lambda: trainledger.spec_state(v), *_shown(v))),
    NOT_A_WORKLOAD.map(lambda v: call(lambda: trainledger.recovery_checkpoint(v), *_shown(v))),
    BAD_INT.map(lambda v: call(lambda: trainledger.StateSpec(num_params=v), *_shown(v))),
    HUGE_PARAMS.map(lambda v: call(lambda: trainledger.StateSpec(num_params=v), *_formats(v))),
    BAD_DTYPE.map(lambda v: call(lambda: trainledger.StateSpec(num_params=10, weights=v), v)),
    st.one_of(st.none(), st.integers(), st.lists(st.integers(), max_size=2)).map(
        lambda v: call(lambda: trainledger.load_workload(v), *_shown(v))
    ),
    BAD_MODEL.map(lambda v: call(lambda: trainledger.load_workload(v), v)),
    st.one_of(st.integers(), st.none(), st.floats()).map(lambda v: call(lambda: trainledger.estimate(v), *_shown(v))),
    BAD_INT.map(lambda v: call(lambda: trainledger.estimate(GOOD_CONFIG, world=v), *_shown(v))),
    BAD_INT.map(lambda v: call(lambda: trainledger.Setup(seq_len=v), *_shown(v))),
    st.integers(min_value=MAX_SEQ_LEN.value + 1).map(
        lambda v: call(lambda: trainledger.Setup(seq_len=v), *_formats(v))
    ),
    st.tuples(st.sampled_from(SIZE_KEYS), BAD_CONFIG_VALUE).map(
        lambda kv: call(lambda: trainledger.estimate({**GOOD_CONFIG, kv[0]: kv[1]}), kv[0])
    ),
    NOT_A_WORKLOAD.map(lambda v: call(lambda: trainledger.fit(GOOD_CONFIG, v), *_shown(v))),
    BAD_INT.map(lambda v: call(lambda: trainledger.FitOptions(device_memory=v), *_shown(v))),
    st.integers(min_value=MAX_SEQ_LEN.value + 1).map(
        lambda v: call(lambda: trainledger.workload_from_hf_config(GOOD_CONFIG, seq_len=v, fake=True), *_formats(v))
    ),
    st.just(call(lambda: trainledger.workload_from_hf_config(HUGE_CONFIG), "this llama model's step needs")),
)


@settings(max_examples=160, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(CALLS)
def test_every_bad_python_call_raises_one_line_input_error(c: Call) -> None:
    fn, bad = c
    with _in_fresh_folder({}) as folder:
        start = time.perf_counter()
        with pytest.raises(InputError) as info:
            fn()
        seconds = time.perf_counter() - start
        assert _snapshot(folder) == {}
    message = str(info.value)
    assert "\n" not in message
    assert not any(f"--{w}" in message for w in ("world", "seq-len", "params", "budgets", "model", "stage"))
    _check_message(message, bad)
    assert seconds < 10


def test_an_optimizer_whose_step_needs_a_closure_is_refused_in_one_line(cli, tmp_path):
    """L-BFGS evaluates the loss up to ``max_iter`` times inside ``step(closure)``: there is no one forward,
    backward and step to trace, and the bare ``step()`` would fail inside the warm-up with torch's TypeError."""
    workload = trainledger.Workload(
        torch.nn.Linear(4, 1), torch.randn(3, 4), loss_fn=lambda out, _b: out.sum(), optimizer=torch.optim.LBFGS
    )
    with pytest.raises(InputError, match=r"LBFGS\.step\(\) needs a closure"):
        trainledger.trace(workload)
    factory = tmp_path / "lbfgs.py"
    factory.write_text(
        "import torch, trainledger\n"
        "def build():\n"
        "    return trainledger.Workload(torch.nn.Linear(4, 1), torch.randn(3, 4), loss_fn=lambda o, b: o.sum(),\n"
        "                                optimizer=torch.optim.LBFGS)\n"
    )
    for command in ("state", "trace", "plan"):
        args = (command, "--model", f"{factory}:build", *(("--budget", "50%") if command == "plan" else ()))
        code, out, err = cli(*args)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "needs a closure" in err, err


FAILING_FACTORIES = """
import torch, trainledger

def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

def step_raises():
    return trainledger.Workload(_model(), torch.randn(3, 5))  # 5 features into a 4-wide layer

def optimizer_is_not_one():
    return trainledger.Workload(_model(), torch.randn(3, 4), optimizer=lambda ps: 5)

def optimizer_raises():
    def factory(ps):
        raise RuntimeError("no optimizer today")
    return trainledger.Workload(_model(), torch.randn(3, 4), optimizer=factory)
"""


@pytest.mark.parametrize(
    ("command", "factory", "message"),
    [
        (("state",), "step_raises", "the step raised RuntimeError"),
        (("state",), "optimizer_is_not_one", "the optimizer factory returned an int 5"),
        (("state", "--no-step"), "optimizer_raises", "the optimizer factory raised RuntimeError: no optimizer today"),
        (("trace",), "optimizer_is_not_one", "the optimizer factory returned"),
        (("pareto", "--budgets", "2", "--cost", "flops"), "step_raises", "the warm-up step raised"),
    ],
)
def test_a_failing_user_step_or_optimizer_is_one_line_in_every_command(cli, tmp_path, command, factory, message):
    """``state`` ran the step without the one-line handling the other commands have, and an optimizer factory that
    raised or returned something else failed with a traceback in every command."""
    path = tmp_path / "factories.py"
    path.write_text(FAILING_FACTORIES)
    code, out, err = cli(command[0], "--model", f"{path}:{factory}", *command[1:])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err, err


def test_pareto_on_a_model_with_no_region_to_recompute_is_one_line(cli):
    """``plan`` said so in one line; ``pareto`` handed the solver a model with no variable and raised a traceback."""
    code, out, err = cli("pareto", "--model", "mlp", "--budgets", "2", "--cost", "flops")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "no region worth recomputing" in err


def test_an_output_path_that_is_a_hard_link_to_an_input_is_refused(cli, tmp_path):
    """Paths were compared, not files: a hard link to the model file was overwritten by the exported policy."""
    model = tmp_path / "model.py"
    model.write_text("from trainledger.examples import gpt_tiny\n\ndef make():\n    return gpt_tiny()\n")
    link = tmp_path / "link.py"
    os.link(model, link)
    before = model.read_bytes()
    code, _out, err = cli(
        "plan", "--model", f"{model}:make", "--cost", "flops", "--budget", "80%", "--export-policy", str(link)
    )
    assert code == 2 and "one of the inputs" in err and model.read_bytes() == before


def test_the_policy_file_never_overwrites_a_module_the_model_imported(cli, tmp_path):
    """The model file is an input; so is the module of layers it imports, known once the model is built."""
    (tmp_path / "my_blocks.py").write_text("from trainledger.examples import gpt_tiny\n\nSOURCE = 'mine'\n")
    model = tmp_path / "model.py"
    model.write_text("from my_blocks import gpt_tiny\n\ndef make():\n    return gpt_tiny()\n")
    before = (tmp_path / "my_blocks.py").read_bytes()
    target = tmp_path / "my_blocks.py"
    code, out, err = cli(
        "plan", "--model", f"{model}:make", "--cost", "flops", "--budget", "80%", "--export-policy", str(target)
    )
    assert code == 2 and out == "" and "module 'my_blocks', which the model imported" in err, err
    assert target.read_bytes() == before


@pytest.mark.parametrize("value", ["-5%", "-.5", "-1GB"])
def test_a_value_starting_with_a_dash_after_a_space_gets_the_values_own_message(cli, value):
    code, _out, err = cli("plan", "--model", "mlp", "--budget", value)
    assert code == 2
    assert "expected one argument" not in err
    assert f"'{value}'" in err and "must be positive" in err.replace("a positive", "positive"), err


def _unwritable(path: Path) -> bool:
    """Make ``path`` a file this process cannot write: read-only, or immutable where the process is root."""
    path.write_text("the user's")
    path.chmod(0o444)
    with contextlib.suppress(OSError):
        open(path, "ab").close()
        # root writes a read-only file: make it immutable if this machine lets us
        if subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False).returncode != 0:
            return False
    return True


def test_an_existing_output_file_that_cannot_be_written_is_refused_before_any_work(cli, tmp_path):
    """A rename in a writable folder goes over a read-only file: refused up front, the file kept; before, the
    command worked to its end, then raised PermissionError (or replaced the file)."""
    target = tmp_path / "kept.json"
    if not _unwritable(target):
        pytest.skip("this machine cannot make a file this process cannot write")
    try:
        code, _out, err = cli("plan", "--model", "mlp", "--budget", "60%", "--save", str(target))
        assert code == 2 and "exists and cannot be written" in err and len(err.strip().splitlines()) == 1, err
        assert target.read_text() == "the user's"
    finally:
        subprocess.run(["chattr", "-i", str(target)], capture_output=True, check=False)


def test_a_write_that_fails_after_the_checks_is_one_line(cli, tmp_path, monkeypatch):
    """The disk filling up as the file is written: one line and exit status 2, no half-written file."""
    import errno

    def full(*_args: Any, **_kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full)
    out = tmp_path / "ledger.json"
    code, _out, err = cli("trace", "--model", "mlp", "--export-json", str(out))
    assert code == 2 and "No space left on device" in err and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.iterdir())


FOREIGN_OPTIMIZER = """
import torch
from trainledger import Workload


def make():
    other = torch.nn.Linear(8, 2)
    return Workload(torch.nn.Linear(8, 2), torch.randn(4, 8), loss_fn=lambda out, _b: out.sum(),
                    optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
"""


def test_an_optimizer_of_another_models_parameters_is_warned_of_in_one_line(cli, tmp_path):
    """It was traced silently (no optimizer phase for the model, both models' weights counted); ``record`` warned
    of the same. A warning, not an error (prompt tuning trains only what is beside the model); the command prints
    every warning on one line, as it prints an error."""
    from trainledger.cli import _warnings_on_one_line

    f = tmp_path / "foreign.py"
    f.write_text(FOREIGN_OPTIMIZER)
    with pytest.warns(UserWarning, match=r"the Workload's SGD trains none of Linear's parameters"):
        code, _, _ = cli("trace", "--model", f"{f}:make")
    assert code == 0
    with _warnings_on_one_line("trace"):
        shown = warnings.formatwarning(UserWarning("two\nlines"), UserWarning, "x.py", 3)
    assert shown == "trainledger trace: warning: two lines\n"
