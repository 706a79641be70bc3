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

import sys
import types
from typing import TYPE_CHECKING

from trainledger.errors import InputError

if TYPE_CHECKING:  # what the names below are, for type checkers; at run time each is imported on first use
    from trainledger import examples
    from trainledger.analytic import FitOptions, Setup, estimate, fit
    from trainledger.declared import StateSpec, declared_ledger
    from trainledger.hf import workload_from_hf_config, workload_from_setup
    from trainledger.inventory import RecoveryCheckpoint, inventory, recovery_checkpoint
    from trainledger.ledger import Category, Entry, Event, Evidence, Ledger, Payload, Peak
    from trainledger.measure import Measurement, measure
    from trainledger.record import Recording, record
    from trainledger.remat import InfeasibleBudget, Plan, pareto, plan
    from trainledger.shard import ShardConfig, ShardResult, shard
    from trainledger.sources import load_workload
    from trainledger.state import StateResult, spec_state, workload_state
    from trainledger.trace import trace
    from trainledger.workload import Workload, run_step

# Every name is imported on first use: ``trainledger estimate`` (the closed form) then never imports torch, and
# a Ctrl-C while torch loads reaches the command line's handler. The planner's numpy and scipy (the ``solve``
# extra) and transformers come the same way, so ``import trainledger`` works without them.
_WHERE = {
    "examples": "trainledger.examples",
    **dict.fromkeys(("FitOptions", "Setup", "estimate", "fit"), "trainledger.analytic"),
    **dict.fromkeys(("StateSpec", "declared_ledger"), "trainledger.declared"),
    **dict.fromkeys(("workload_from_hf_config", "workload_from_setup"), "trainledger.hf"),
    **dict.fromkeys(("RecoveryCheckpoint", "inventory", "recovery_checkpoint"), "trainledger.inventory"),
    **dict.fromkeys(("Category", "Entry", "Event", "Evidence", "Ledger", "Payload", "Peak"), "trainledger.ledger"),
    **dict.fromkeys(("Measurement", "measure"), "trainledger.measure"),
    **dict.fromkeys(("Recording", "record"), "trainledger.record"),
    **dict.fromkeys(("InfeasibleBudget", "Plan", "pareto", "plan"), "trainledger.remat"),
    **dict.fromkeys(("ShardConfig", "ShardResult", "shard"), "trainledger.shard"),
    "load_workload": "trainledger.sources",
    **dict.fromkeys(("StateResult", "spec_state", "workload_state"), "trainledger.state"),
    "trace": "trainledger.trace",
    **dict.fromkeys(("Workload", "run_step"), "trainledger.workload"),
}


def __getattr__(name: str) -> object:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'trainledger' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(where)
    value = module if name == "examples" else getattr(module, name)
    globals()[name] = value  # found once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


class _Package(types.ModuleType):
    """Importing a subpackage sets it on its package as an attribute: ``trainledger.trace`` would be the package
    ``trainledger.trace`` once anything imported it, not the function of that name. The names of functions
    the package shares with its subpackages keep naming the functions."""

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, types.ModuleType) and _WHERE.get(name, "") == f"{__name__}.{name}" and name != "examples":
            return  # the subpackage stays in sys.modules; the package's name is the function's
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


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
    "Recording",
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
    "record",
    "recovery_checkpoint",
    "run_step",
    "shard",
    "spec_state",
    "trace",
    "workload_from_hf_config",
    "workload_from_setup",
    "workload_state",
]
