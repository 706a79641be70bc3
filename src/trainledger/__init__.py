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
from trainledger.analytic import FitOptions, Setup, estimate, fit
from trainledger.declared import StateSpec, declared_ledger
from trainledger.errors import InputError
from trainledger.inventory import RecoveryCheckpoint, inventory, recovery_checkpoint
from trainledger.ledger import Category, Entry, Event, Evidence, Ledger, Payload, Peak
from trainledger.measure import Measurement, measure
from trainledger.shard import ShardConfig, ShardResult, shard
from trainledger.sources import load_workload
from trainledger.state import StateResult, spec_state, workload_state
from trainledger.trace import trace
from trainledger.workload import Workload, run_step

# The planner needs numpy and scipy (the ``solve`` extra): imported on first use, so ``import trainledger``
# works without them and the error, if any, says how to install them.
_LAZY = {"plan": "plan", "Plan": "Plan", "InfeasibleBudget": "InfeasibleBudget", "pareto": "pareto"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from trainledger import remat

        return getattr(remat, _LAZY[name])
    if name in ("workload_from_hf_config", "workload_from_setup"):  # transformers is imported on first use
        from trainledger import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'trainledger' has no attribute {name!r}")


__all__ = [
    "Category",
    "Entry",
    "Event",
    "Evidence",
    "FitOptions",
    "InfeasibleBudget",
    "InputError",
    "Ledger",
    "Measurement",
    "Payload",
    "Peak",
    "Plan",
    "RecoveryCheckpoint",
    "Setup",
    "ShardConfig",
    "ShardResult",
    "StateResult",
    "StateSpec",
    "Workload",
    "declared_ledger",
    "estimate",
    "examples",
    "fit",
    "inventory",
    "load_workload",
    "measure",
    "pareto",
    "plan",
    "recovery_checkpoint",
    "run_step",
    "shard",
    "spec_state",
    "trace",
    "workload_from_hf_config",
    "workload_from_setup",
    "workload_state",
]
