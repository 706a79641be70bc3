"""Nothing trainledger does keeps the user's model alive once the user lets go of it: no reference cycle
through what it made (a closure over itself, a recursive inner function) holds the model, its optimizer or
their tensors until the garbage collector happens to run. On a GPU that memory stayed taken; under
``torchrun`` a model left to the collection at interpreter exit took gloo's worker threads down with it."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from trainledger import examples, plan, record, trace


@pytest.fixture
def no_collection() -> Iterator[None]:
    # the first optimizer a process makes imports torch._dynamo, whose import keeps the frames it ran under
    # (``torch.fx.wrap`` holds its own frame), the test's among them: import it before
    torch.optim.AdamW(nn.Linear(1, 1).parameters())
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _traced() -> list[Any]:
    w = examples.gpt_tiny(n_layer=2, n_embd=32, seq_len=16, batch_size=2)
    trace(w)
    return [w.model, w]


def _planned_applied_and_removed() -> list[Any]:
    w = examples.gpt_tiny(n_layer=2, n_embd=32, seq_len=16, batch_size=2)
    p = plan(w, budget="90%")
    assert p.regions
    p.apply(w.model)
    p.remove(w.model)
    return [w.model, w, p]


def _exported_applied_and_removed(tmp_path: Path) -> list[Any]:
    import importlib.util

    w = examples.gpt_tiny(n_layer=2, n_embd=32, seq_len=16, batch_size=2)
    p = plan(w, budget="90%")
    p.export_policy(tmp_path / "policy_for_lets_go.py")
    spec = importlib.util.spec_from_file_location("policy_for_lets_go", tmp_path / "policy_for_lets_go.py")
    assert spec is not None and spec.loader is not None
    policy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(policy)
    policy.apply(w.model)
    policy.remove(w.model)
    return [w.model, w]


def _recorded() -> list[Any]:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    with record(model, opt, steps=1) as rec:
        for _ in range(2):
            model(torch.randn(3, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert rec.steps == (1,)
    return [model, opt, rec]


CASES: dict[str, Callable[[Path], list[Any]]] = {
    "trace": lambda _: _traced(),
    "plan applied and removed": lambda _: _planned_applied_and_removed(),
    "exported policy applied and removed": _exported_applied_and_removed,
    "record": lambda _: _recorded(),
}


@pytest.mark.parametrize("case", CASES)
def test_the_model_goes_when_the_user_lets_go(case: str, tmp_path: Path, no_collection: None) -> None:
    refs = [weakref.ref(x) for x in CASES[case](tmp_path)]
    assert [type(r()).__name__ for r in refs if r() is not None] == []


def test_a_recording_kept_to_read_keeps_neither_the_model_nor_its_optimizer(no_collection: None) -> None:
    """A notebook keeps ``rec`` and trains a new model: the old one and its optimizer state went only when
    ``rec`` did (on a GPU, all of their memory). The ledgers stay readable; entering again is one line."""
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters())
    with record(model, opt) as rec:
        model(torch.randn(5, 6)).square().mean().backward()
        opt.step()
    peak = rec.peak().bytes
    refs = [weakref.ref(model), weakref.ref(opt)]
    del model, opt
    assert [r() for r in refs] == [None, None]
    assert rec.ledger(step=0).peak().bytes == peak > 0
    from trainledger import InputError

    with pytest.raises(InputError, match="has been freed; make a new record"):
        rec.__enter__()
    assert not rec.running
