"""A training loop under ``torchrun`` on gloo, recorded on every rank: ``torchrun --nproc-per-node N
tests/record_dist.py ddp|fsdp2 RUN_DIR`` writes ``RUN_DIR/rank-<r>.json`` per rank. Rank r's micro-batch is
``r + 1`` times the first's, so the ranks' peaks differ."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainledger import record


def main(strategy: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    if strategy == "ddp":
        step_model: nn.Module = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        fully_shard(model)
        step_model = model
    opt = torch.optim.AdamW(model.parameters())
    torch.manual_seed(rank)
    with record(model, opt, steps=1, name=f"mlp-{strategy}") as rec:
        for _ in range(3):
            step_model(torch.randn(8 * (rank + 1), 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    rec.save(Path(out) / f"rank-{rank}.json")
    # DDP's reducer must go before its process group: on gloo, a reducer outliving the group aborts the process
    # at exit about one run in three ("terminate called without an active exception"), with or without record
    del step_model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
