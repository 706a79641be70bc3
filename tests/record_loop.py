"""A hand-written training loop with what real loops carry: gradient accumulation over 4 micro-batches, a
GradScaler, gradient clipping, a learning-rate scheduler, dropout. Built the same way every time from a seed.

``python -m tests.record_loop oracle`` runs it under ``torch.profiler`` (``profile_memory=True``, started
before anything is built) and prints, per step, the largest running sum of the profiler's allocation events
inside the step; ``python -m tests.record_loop record`` runs it inside ``trainledger.record`` and prints each
step's traced peak. A step is ``record``'s: from one optimizer step's return to the next one's. The two runs
are separate processes, so the profiler's oracle shares nothing with the tracer.

``... oracle --skip K`` and ``... record --skip K`` put an inf into step K's first micro-batch: its gradients
are NaN and the GradScaler skips that optimizer step (the oracle's step then ends where ``scaler.step``
returns). ``--compile`` runs the model through ``torch.compile`` (inductor) in both: the recorded
compiled calls are one event each, their buffers inside measured (see ``trainledger.record``).
``--checkpoint`` runs two parts of the model under ``torch.utils.checkpoint`` (dropout inside one): each keeps
the CPU generator's state until its backward.
"""

from __future__ import annotations

import gc
import json
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

ACCUMULATION = 4
NUM_STEPS = 4


class Checkpointed(nn.Module):
    """Its modules run under ``torch.utils.checkpoint``: recomputed in backward, the CPU generator's state kept."""

    def __init__(self, *modules: nn.Module) -> None:
        super().__init__()
        self.inner = nn.Sequential(*modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def build(seed: int = 0, skip: int | None = None, checkpointed: bool = False) -> dict[str, Any]:
    """The loop's objects; with ``skip``, step ``skip``'s first micro-batch holds an inf (its step is skipped);
    ``checkpointed``: the first three and the next two modules each under ``torch.utils.checkpoint``."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8)
    )
    if checkpointed:
        model = nn.Sequential(Checkpointed(*model[:3]), Checkpointed(*model[3:5]), model[5])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [(torch.randn(16, 32), torch.randint(0, 8, (16,))) for _ in range(ACCUMULATION * NUM_STEPS)]
    if skip is not None:
        data[skip * ACCUMULATION][0][0, 0] = float("inf")
    return {
        "model": model,
        "opt": opt,
        "sched": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        "scaler": torch.amp.GradScaler("cpu"),
        "data": data,
    }


def train(model: nn.Module, opt: Any, sched: Any, scaler: Any, data: list[Any], after_step: Any = None) -> None:
    for i, (x, y) in enumerate(data):
        loss = F.cross_entropy(model(x), y) / ACCUMULATION
        scaler.scale(loss).backward()
        if (i + 1) % ACCUMULATION == 0:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            if after_step is not None:
                after_step()
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sched.step()


def lbfgs() -> tuple[nn.Module, torch.optim.LBFGS, Any]:
    """A linear fit by L-BFGS, which keeps its history of directions and steps as lists of tensors in its
    state: the model, the optimizer and the closure ``opt.step`` takes."""
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=5, history_size=4)
    x, y = torch.randn(8, 16), torch.randn(8, 1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        return loss

    return model, opt, closure


def compiled(run: dict[str, Any], compile: bool) -> dict[str, Any]:
    """The loop's objects with the model the loop calls compiled (the optimizer and record keep the module)."""
    return {**run, "model": torch.compile(run["model"])} if compile else run


def oracle_peaks(skip: int | None = None, compile: bool = False, checkpointed: bool = False) -> list[int]:
    from torch.profiler import ProfilerActivity, profile

    from tests.oracle_profiler import boundary, step_peaks

    gc.collect()
    gc.disable()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run = build(skip=skip, checkpointed=checkpointed)
        boundary()
        train(**compiled(run, compile), after_step=boundary)
    gc.enable()
    return step_peaks(prof)


def recorded_peaks(skip: int | None = None, compile: bool = False, checkpointed: bool = False) -> list[int]:
    from trainledger import record

    gc.collect()
    gc.disable()
    run = build(skip=skip, checkpointed=checkpointed)
    loop = compiled(run, compile)
    with record(run["model"], run["opt"]) as rec:
        train(**loop)
    gc.enable()
    return [rec.ledger(step=k).peak().bytes for k in rec.steps]


if __name__ == "__main__":
    skipped = int(sys.argv[sys.argv.index("--skip") + 1]) if "--skip" in sys.argv else None
    peaks = oracle_peaks if sys.argv[1] == "oracle" else recorded_peaks
    print(json.dumps(peaks(skipped, compile="--compile" in sys.argv, checkpointed="--checkpoint" in sys.argv)))
