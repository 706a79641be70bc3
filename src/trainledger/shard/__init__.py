"""ZeRO and FSDP: per-rank ledgers, the communication they add, and real multi-process runs.

The transform (:func:`shard`) and the communication model are pure arithmetic on ledgers and import no
torch; the launcher (:mod:`trainledger.shard.launch`), which runs the step on ``torch.distributed``, is
imported on demand.

Example:
    >>> from trainledger.declared import StateSpec, declared_ledger
    >>> led = declared_ledger(StateSpec(num_params=7_500_000_000, weights="fp16", master="fp32", grads="fp16"))
    >>> shard(led, world_size=64, strategy="zero3").model_state_bytes()
    1875000000
"""

from trainledger.shard._comm import Collective, CommTime, estimate_time, wire_bytes
from trainledger.shard._config import ENGINES, STRATEGIES, Engine, ShardConfig, Strategy, parse_strategy
from trainledger.shard._fsdp import totals_on_step_clock
from trainledger.shard._partition import greedy_owners, shard_rows
from trainledger.shard._result import RankLedgers, ShardResult
from trainledger.shard._summary import RankSummary, ShardReport, ShardSummary
from trainledger.shard._transform import shard
from trainledger.shard._units import infer_units

__all__ = [
    "ENGINES",
    "STRATEGIES",
    "Collective",
    "CommTime",
    "Engine",
    "RankLedgers",
    "RankSummary",
    "ShardConfig",
    "ShardReport",
    "ShardResult",
    "ShardSummary",
    "Strategy",
    "estimate_time",
    "greedy_owners",
    "infer_units",
    "parse_strategy",
    "shard",
    "shard_rows",
    "totals_on_step_clock",
    "wire_bytes",
]
