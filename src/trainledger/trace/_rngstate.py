"""Generator states copied during the step: made outside the dispatcher, so no op shows them.

``torch.utils.checkpoint.checkpoint(..., preserve_rng_state=True)`` (the default) copies the CPU generator's
state when each checkpointed call starts (``torch.get_rng_state()``: 5,056 bytes of uint8) and keeps it until
that call's backward is over, to draw the same random numbers when it recomputes. While the traced step
runs, :func:`rng_states_seen` has each ``torch.get_rng_state()`` call tracked as a storage made at that
point of the event clock; the tracer's weak reference on it gives its free event, as for any storage.

On a CUDA step the CPU state, and the CUDA generators' states ``torch.utils.checkpoint`` saves beside it
(``get_device_states``), are host memory, not counted on the device: nothing is tracked there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from trainledger.declared import RNG_STATE_ROLE
from trainledger.ledger import Category

if TYPE_CHECKING:
    from trainledger.trace._tracer import StepTracer


@contextlib.contextmanager
def rng_states_seen(tracer: StepTracer, *, enabled: bool = True) -> Iterator[None]:
    """While open, every ``torch.get_rng_state()`` returns its state as before and ``tracer`` tracks it
    (category other, role :data:`RNG_STATE_ROLE`, owned by the module running). ``torch.get_rng_state`` is
    looked up on ``torch`` at each call (``torch.utils.checkpoint``, ``torch.random.fork_rng``), so it is
    replaced there for the step and put back after it."""
    if not enabled:
        yield
        return
    original = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        state = original()
        # "#event" names the next event, the first the state is alive for (renumbered by stack extension)
        tracer.allocated_outside_dispatch(state, f"rng_state#{tracer.num_events}", Category.OTHER, RNG_STATE_ROLE)
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original
