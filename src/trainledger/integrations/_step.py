"""What both callbacks do: record one optimizer step of a run, then write its ledger and its page."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainledger.errors import InputError
from trainledger.record import Recording, record
from trainledger.report.html import write_html

FOLDER = "trainledger"


@dataclass(frozen=True)
class Written:
    """The files a recorded step was written to."""

    ledger: Path
    """``<output>/trainledger/step-<k>/rank-<r>.json``."""
    html: Path | None
    """The page beside it (``None`` when the callback was made with ``html=False``)."""


class StepRecorder:
    """Records optimizer step ``step`` of a run: call :meth:`begin` before every step (or micro-batch) and
    :meth:`end` after it; the step is written once its optimizer step has returned.

    Arguments:
        step: the optimizer step to record: the first batch that begins at a global step count of at least
            ``step`` (0 is the first, which also creates the optimizer's state lazily, so 1 or later shows a
            steady step). At least, not equal: Lightning counts every optimizer's step, so a manually optimized
            GAN's batches begin at 0, 2, 4... The folder is named after the count the recorded batch began at.
        html: also write the HTML page.
    """

    def __init__(self, step: int = 1, *, html: bool = True) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InputError(f"step={step!r}: give the optimizer step to record, a whole number from 0 (e.g. 1)")
        if not isinstance(html, bool):
            raise InputError(f"html={html!r}: give True to write the HTML page beside the ledger, or False")
        self.step = step
        self.html = html
        self.written: Written | None = None
        self.unwritten: str | None = None
        """Why the recorded step could not be written (it was warned as training went on), or ``None``."""
        self._rec: Recording | None = None
        self._raised_hook: Any = None  # on the model while recording: a forward that raised ends the recording
        self._began_at = -1  # the global step count the recorded batch began at
        self._last_seen = -1

    def begin(self, global_step: int, model: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self._last_seen = global_step
        if global_step < self.step or self._rec is not None or self.written is not None or self.unwritten:
            return
        _leave_abandoned(self)
        self._began_at = global_step
        model = _unwrap_model(model)
        self._rec = record(model, *(_unwrap_optimizer(o) for o in optimizers), steps=0)
        self._rec.__enter__()
        _OPEN.append(self)
        self._raised_hook = model.register_forward_hook(self._forward_ended, always_call=True)

    def _forward_ended(self, _model: nn.Module, _args: Any, output: Any) -> None:
        """After every forward of the model while recording, and after one that raised an ``Exception``
        (``always_call``; PyTorch runs no hook for a ``KeyboardInterrupt``): then the training loop is
        unwinding, and nothing of the recording may outlive it (its dispatch mode would go on tracing every op
        of the process, a notebook's included)."""
        if output is None and sys.exc_info()[1] is not None:
            self.stop(discard=True)

    def end(self, output_dir: str | Path) -> Written | None:
        rec = self._rec
        if rec is None or not rec.running or 0 not in rec.steps:
            return None
        self.stop()
        rank = rec.ledger(step=0).meta.get("rank", 0)
        folder = Path(output_dir) / FOLDER / f"step-{self._began_at}"
        try:
            path = rec.save(folder / f"rank-{rank}.json", step=0)
            html = write_html(rec.ledger(step=0), folder / f"rank-{rank}.html") if self.html else None
        except InputError as exc:  # the run goes on: a file trainledger cannot write is no reason to stop training
            self.unwritten = str(exc)
            warnings.warn(f"trainledger: step {self._began_at} was recorded but not written: {exc}", stacklevel=2)
            return None
        self.written = Written(path, html)
        return self.written

    def stop(self, *, discard: bool = False) -> None:
        """Leave ``record`` if it is running (at the end of training, whatever happened); with ``discard``,
        as a loop that raised does: the step open now is not recorded, and a later step may be (a run that
        goes on after the error, as ``auto_find_batch_size`` does after running out of memory)."""
        if self._raised_hook is not None:
            self._raised_hook.remove()
            self._raised_hook = None
        if self in _OPEN:
            _OPEN.remove(self)
        rec = self._rec
        if rec is not None and rec.running:
            if discard:
                rec.__exit__(RuntimeError, RuntimeError("training raised"), None)
            else:
                rec.__exit__(None, None, None)
        if discard and self.written is None:
            self._rec = None

    def finish(self) -> None:
        """At the end of training: leave ``record``, and say so when the step was never written."""
        self.stop()
        if self.written is None and self.unwritten is None:
            reached = (
                f"the last batch began at global step {self._last_seen}" if self._last_seen >= 0 else "no batch ran"
            )
            warnings.warn(
                f"trainledger: step {self.step} was not recorded ({reached}); nothing was written: train longer or "
                "ask for an earlier step",
                stacklevel=2,
            )


_OPEN: list[StepRecorder] = []
"""Recorders whose recording is running: one at a time (``record`` refuses a second)."""


def _leave_abandoned(starting: StepRecorder) -> None:
    """Discard what a run that raised outside the model's forward left running (in backward, in the optimizer
    step, in a callback), before ``starting`` records: no hook of a Trainer sees such an error, and the next
    run's recording would be refused."""
    for other in [r for r in _OPEN if r is not starting]:
        warnings.warn(
            "trainledger: a step recording left open by an earlier training run (it raised before the step ended) "
            "was discarded",
            stacklevel=3,
        )
        other.stop(discard=True)


_WRAPPERS = frozenset({"DistributedDataParallel", "FullyShardedDataParallel", "DataParallel"})


def _unwrap_model(model: Any) -> nn.Module:
    """The module inside DDP's or FSDP1's wrapper (the one whose calls name the ops)."""
    while type(model).__name__ in _WRAPPERS and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def _unwrap_optimizer(opt: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` or Lightning's ``LightningOptimizer``."""
    for attr in ("optimizer", "_optimizer"):
        inner = getattr(opt, attr, None)
        if isinstance(inner, torch.optim.Optimizer) and inner is not opt:
            return _unwrap_optimizer(inner)
    return opt
