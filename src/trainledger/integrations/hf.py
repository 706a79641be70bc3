"""A Hugging Face ``transformers.TrainerCallback`` that records one optimizer step of a ``Trainer`` run.

Example (not run here: it trains)::

    from trainledger.integrations.hf import TrainledgerCallback

    trainer = Trainer(model, args, train_dataset=data, callbacks=[TrainledgerCallback(step=1)])
    trainer.train()
    # <args.output_dir>/trainledger/step-1/rank-0.json and rank-0.html
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        "trainledger.integrations.hf needs transformers (and accelerate, which Trainer uses): "
        "pip install 'trainledger[hf]'"
    ) from exc

from trainledger.integrations._step import StepRecorder, Written

__all__ = ["TrainledgerCallback"]


class TrainledgerCallback(TrainerCallback):  # type: ignore[misc]
    """Records optimizer step ``step`` (the first to begin at a ``state.global_step`` of at least ``step``; gradient
    accumulation's micro-batches included) and writes its ledger and page under ``args.output_dir/trainledger``.

    Arguments:
        step: the optimizer step to record (default 1: the first steady one, after the optimizer's state exists).
        html: also write the HTML page.
    """

    def __init__(self, step: int = 1, *, html: bool = True) -> None:
        self.recorder = StepRecorder(step, html=html)

    @property
    def written(self) -> Written | None:
        """Where the step was written, once it was."""
        return self.recorder.written

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # a Trainer has no hook for an error: what an earlier ``train()`` that raised left open ends here
        self.recorder.stop(discard=True)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if model is not None and optimizer is not None:
            self.recorder.begin(state.global_step, model, [optimizer])

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.recorder.end(args.output_dir)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.recorder.finish()
