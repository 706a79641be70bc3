"""trainledger: what occupies memory at the peak instant of a PyTorch training step, and why.

The public surface is small; everything is re-exported here.

Example:
    >>> import trainledger
    >>> r = trainledger.workload_state(trainledger.examples.seed_423())
    >>> r.payload.bytes
    13536
"""

from __future__ import annotations

__version__ = "0.1.0"

from trainledger import examples
from trainledger.declared import StateSpec, declared_ledger
from trainledger.errors import InputError
from trainledger.inventory import RecoveryCheckpoint, inventory, recovery_checkpoint
from trainledger.ledger import Category, Entry, Event, Evidence, Ledger, Payload, Peak
from trainledger.measure import Measurement, measure
from trainledger.state import StateResult, spec_state, workload_state
from trainledger.trace import trace
from trainledger.workload import Workload, load_workload, run_step

__all__ = [
    "Category",
    "Entry",
    "Event",
    "Evidence",
    "InputError",
    "Ledger",
    "Measurement",
    "Payload",
    "Peak",
    "RecoveryCheckpoint",
    "StateResult",
    "StateSpec",
    "Workload",
    "declared_ledger",
    "examples",
    "inventory",
    "load_workload",
    "measure",
    "recovery_checkpoint",
    "run_step",
    "spec_state",
    "trace",
    "workload_state",
]
