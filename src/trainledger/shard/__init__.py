"""ZeRO and FSDP: per-rank ledgers, the communication they add, and real multi-process runs.

The transform (:func:`shard`) and the communication model are pure arithmetic on ledgers; the launcher
(:mod:`trainledger.shard.launch`) runs the step on ``torch.distributed`` and is imported on demand.
"""

from trainledger.shard._summary import RankSummary, ShardReport, ShardSummary
from trainledger.shard.comm import Collective, CommTime, estimate_time, wire_bytes
from trainledger.shard.transform import (
    STRATEGIES,
    ShardConfig,
    ShardResult,
    Strategy,
    greedy_owners,
    infer_units,
    parse_strategy,
    shard,
    shard_rows,
)

__all__ = [
    "STRATEGIES",
    "Collective",
    "CommTime",
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
    "wire_bytes",
]
