"""The optional integrations' modules import their framework at the top: without the extra installed, their
doctests are not collected (their tests skip and say why). A run without the slow tests (``-m "not slow"``)
does not import the modules that hold no doctest: Lightning and transformers' Trainer take seconds to import,
and only slow tests use them; the whole suite collects every module."""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from pathlib import Path

import pytest

# OpenMP's threads spin while they wait for the next parallel region: on a machine shared by several processes
# the spinning takes the cores the other threads of the step need (the tests' CPU time was half spinning, their
# wall time twice as long). Passive waiting keeps the thread count, so every kernel's buffers and every figure
# stay as they are; set before torch is imported (here and in the processes the tests start).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

collect_ignore = [
    path
    for path, module in (
        ("src/trainledger/integrations/hf.py", "transformers"),
        ("src/trainledger/integrations/lightning.py", "lightning"),
    )
    if importlib.util.find_spec(module) is None
]


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    fast = "not slow" in (config.getoption("markexpr") or "")
    if fast and collection_path.suffix == ".py" and collection_path.is_relative_to(config.rootpath / "src"):
        return ">>>" not in collection_path.read_text(encoding="utf-8") or None
    return None


# A full collection of the cyclic garbage collector walks every object it tracks: by the end of the fast subset
# 850,000, nearly all made by importing torch, transformers, sympy and the rest, and kept until the process ends;
# 0.4 to 0.9 s each time on this machine. A measured step collects fully twice (quiet_gc) and the collector starts
# full collections itself as objects pile up: 37 in a run of the fast subset, 16 to 20 s of its CPU time. So the
# collector stays off while the modules are imported and collected, and whenever a test has imported modules, once
# it has ended, what is left is frozen (gc.freeze, as the trainledger program does when it ends: cli.entry): never
# walked again, still freed by reference counting when dropped. A test's own objects are never frozen while it
# runs, so every collection in a test (and record's walk over gc.get_objects()) sees what the test made as
# before; what outlives a test (a module's fixtures, the shared traces) is frozen with the modules.
_MODULES_FROZEN = [0]
gc.disable()  # until the collection of the tests ends


def _freeze_if_imported() -> None:
    if len(sys.modules) != _MODULES_FROZEN[0]:
        gc.collect()
        gc.freeze()
        _MODULES_FROZEN[0] = len(sys.modules)


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.enable()
    _freeze_if_imported()


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _freeze_if_imported()
