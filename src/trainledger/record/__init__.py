"""Record the user's own training loop, step by step, without changing it (see :func:`record`).

The optional integrations (``trainledger.integrations``) build on this: a Hugging Face ``TrainerCallback``
and a Lightning ``Callback`` that record a chosen step of a run.
"""

from __future__ import annotations

from trainledger.record._loop import Recording, record

__all__ = ["Recording", "record"]
