"""A training loop under FSDP2 (``fully_shard`` on each layer and the root) on gloo, recorded or measured.

``python -m tests.record_fsdp oracle OUT`` runs it under ``torch.profiler`` (``profile_memory=True``, started
before anything is built) and writes, per step, the largest running sum of the profiler's allocation events
inside the step (from one optimizer step's return to the next, as ``record`` counts steps) into
``OUT/rank-0.json``; ``python -m tests.record_fsdp record OUT`` runs it inside ``trainledger.record`` and writes
each step's traced peak. Both join a one-process gloo group of their own; under ``torchrun --nproc-per-node N``
each rank writes its own file. FSDP2 frees each layer's gathered parameters after its forward and
gathers them again for its backward by resizing their storages, which no dispatched op shows: the traced
peak equals the allocator's only when ``record`` follows those resizes.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

NUM_STEPS = 3


def build() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)  # few temporaries: backward sets the peak
    gc.collect()  # fully_shard leaves the first layer's unsharded parameters in a reference cycle
    torch.manual_seed(1 + dist.get_rank())
    data = [torch.randn(64, 32) for _ in range(NUM_STEPS)]
    return {"model": model, "opt": opt, "data": data}


def train(model: nn.Module, opt: Any, data: list[torch.Tensor]) -> None:
    # gloo's worker threads let go of a collective's buffers a moment after wait() returns: a pause after each
    # wait makes every free happen where the step drops the buffer, in both runs (see settled_collectives)
    from trainledger.shard._observe import settled_collectives

    with settled_collectives() if dist.get_world_size() > 1 else contextlib.nullcontext():
        for x in data:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


def oracle_peaks() -> list[int]:
    from torch.profiler import ProfilerActivity, profile

    from tests.oracle_profiler import boundary, step_peaks

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run = build()
        gc.disable()
        run["opt"].register_step_post_hook(boundary)
        boundary()
        train(**run)
    gc.enable()
    return step_peaks(prof)


def recorded_peaks() -> list[int]:
    from trainledger import record

    run = build()
    gc.disable()
    with record(run["model"], run["opt"]) as rec:
        train(**run)
    gc.enable()
    return [rec.ledger(step=k).peak().bytes for k in rec.steps]


if __name__ == "__main__":
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    peaks = oracle_peaks() if sys.argv[1] == "oracle" else recorded_peaks()
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(peaks))
    dist.destroy_process_group()
