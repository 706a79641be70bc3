"""A Lightning ``Callback`` that records one optimizer step of a ``lightning.pytorch.Trainer`` run.

Example (not run here: it trains)::

    from trainledger.integrations.lightning import TrainledgerCallback

    trainer = lightning.pytorch.Trainer(max_steps=3, callbacks=[TrainledgerCallback(step=1)])
    trainer.fit(module, data)
    # <trainer.default_root_dir>/trainledger/step-1/rank-0.json and rank-0.html
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        "trainledger.integrations.lightning needs lightning: pip install 'trainledger[lightning]'"
    ) from exc

from trainledger.errors import InputError
from trainledger.integrations._step import StepRecorder, Written

__all__ = ["TrainledgerCallback"]


class TrainledgerCallback(Callback):  # type: ignore[misc]
    """Records optimizer step ``step`` (the first batch to begin at a ``trainer.global_step`` of at least ``step``:
    Lightning counts every optimizer's step; accumulated batches included) and writes its ledger and page under
    ``output_dir`` (default: the trainer's ``default_root_dir``) ``/trainledger``.

    Arguments:
        step: the optimizer step to record (default 1: the first steady one).
        output_dir: where to write (default: ``trainer.default_root_dir``).
        html: also write the HTML page.
    """

    def __init__(self, step: int = 1, *, output_dir: str | Path | None = None, html: bool = True) -> None:
        self.recorder = StepRecorder(step, html=html)
        self.output_dir = _output_dir(output_dir)

    @property
    def written(self) -> Written | None:
        """Where the step was written, once it was."""
        return self.recorder.written

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.recorder.begin(trainer.global_step, pl_module, trainer.optimizers)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.recorder.end(self.output_dir if self.output_dir is not None else trainer.default_root_dir)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.recorder.finish()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.recorder.stop(discard=True)  # training raised: leave record (the exception is the one to see)


def _output_dir(given: object) -> Path | None:
    """``output_dir`` checked as the callback is made, not after the recorded step has run."""
    if given is None:
        return None
    if not isinstance(given, str | Path) or not str(given):
        raise InputError(f"output_dir={given!r}: give the folder to write under (a str or Path), or None")
    path = Path(given)
    if path.exists() and not path.is_dir():
        raise InputError(f"output_dir {str(path)!r} is a file, not a folder: give the folder to write under")
    return path
