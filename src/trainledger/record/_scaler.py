"""Steps a GradScaler skips: ``GradScaler.step(optimizer)`` that finds infs or NaNs in the gradients never
calls ``optimizer.step()``, so no optimizer hook marks the end of that step.

Every ``GradScaler`` (``torch.amp``'s, ``torch.cuda.amp``'s, FSDP's ``ShardedGradScaler``) decides in
``_maybe_opt_step``: it sums its ``found_inf`` flags and calls ``optimizer.step()`` only when they are zero.
While ``record`` runs, that method is wrapped to tell it, after the decision, which optimizers were passed
over. The wrapper calls the original with the same arguments and adds no tensor op: the scaler's decision,
its scale and the loop's results are what they would be.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

SKIPPED_NOTE = (
    "the GradScaler found infs or NaNs in the gradients and skipped optimizer.step(): this step ran forward, "
    "backward and the scaler's unscale (phase optimizer) but changed no weight and no optimizer state"
)


@contextlib.contextmanager
def watching_skipped_steps(
    stepped: Callable[[torch.optim.Optimizer], bool], skipped: Callable[[torch.optim.Optimizer], None]
) -> Iterator[None]:
    """While active, ``skipped(optimizer)`` is called when a GradScaler passes over ``optimizer.step()``.

    Arguments:
        stepped: ``stepped(optimizer)`` tells whether ``optimizer.step()`` returned since it was last asked
            (the caller's optimizer hooks know).
        skipped: called with the optimizer whose step the scaler skipped.
    """
    scaler_class = torch.amp.GradScaler
    original = scaler_class.__dict__["_maybe_opt_step"]

    def _maybe_opt_step(scaler: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        stepped(optimizer)  # forget earlier steps: only this call's decision counts
        out = original(scaler, optimizer, *args, **kwargs)
        if not stepped(optimizer):
            skipped(optimizer)
        return out

    scaler_class._maybe_opt_step = _maybe_opt_step  # type: ignore[method-assign]
    try:
        yield
    finally:
        scaler_class._maybe_opt_step = original  # type: ignore[method-assign]
