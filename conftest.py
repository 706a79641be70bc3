"""The optional integrations' modules import their framework at the top: without the extra installed, their
doctests are not collected (their tests skip and say why). A run without the slow tests (``-m "not slow"``)
does not import the modules that hold no doctest: Lightning and transformers' Trainer take seconds to import,
and only slow tests use them; the whole suite collects every module."""

from __future__ import annotations

import importlib.util
import os
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
