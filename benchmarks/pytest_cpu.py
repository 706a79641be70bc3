"""A pytest plugin: the CPU time of each test and of collection, which moves far less than wall time when the
machine is shared (``benchmarks/results/test_speed.md``).

    python -m pytest -q -m "not slow" -p no:cacheprovider -p benchmarks.pytest_cpu

writes ``out/test_cpu.json`` (or ``$TEST_CPU_JSON``): ``rows`` as ``[test id, CPU s, wall s]``, ``collect_cpu``
and ``total_cpu`` (seconds since the process started). CPU time is user + system of this process and of the
processes it waited for (a test's subprocesses), around each test's setup, call and teardown.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest

_ROWS: list[tuple[str, float, float]] = []
_COLLECTED: dict[str, float] = {}


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    cpu, wall = _cpu_seconds(), time.perf_counter()
    yield
    _ROWS.append((item.nodeid, _cpu_seconds() - cpu, time.perf_counter() - wall))


def pytest_collection_finish(session: pytest.Session) -> None:
    _COLLECTED["cpu"] = _cpu_seconds()


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = Path(os.environ.get("TEST_CPU_JSON", "out/test_cpu.json"))
    path.parent.mkdir(parents=True, exist_ok=True)
    summary = {"rows": _ROWS, "collect_cpu": _COLLECTED.get("cpu"), "total_cpu": _cpu_seconds()}
    path.write_text(json.dumps(summary, indent=1))
