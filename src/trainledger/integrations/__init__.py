"""Record a chosen step of a run driven by a training framework, as optional extras.

- ``trainledger.integrations.hf.TrainledgerCallback``: a ``transformers.TrainerCallback``
  (``pip install 'trainledger[hf]'``);
- ``trainledger.integrations.lightning.TrainledgerCallback``: a Lightning ``Callback``
  (``pip install 'trainledger[lightning]'``).

Each records optimizer step ``step`` of the run with :func:`trainledger.record` and writes, under the run's
output folder, ``trainledger/step-<k>/rank-<r>.json`` (the ledger ``trainledger report`` reads) and
``rank-<r>.html`` beside it (the page). Under ``torchrun`` every rank writes its own ledger into that one
folder; ``trainledger report <output>/trainledger/step-<k>`` then compares the ranks.
"""

from __future__ import annotations

from trainledger.integrations._step import StepRecorder

__all__ = ["StepRecorder"]
