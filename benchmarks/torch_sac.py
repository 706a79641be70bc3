"""PyTorch's own SAC MILP (``torch.distributed._tools.sac_ilp.sac_milp``) on the same workload, on CPU.

PyTorch's pipeline (``torch.distributed._tools.ilp_utils.aggregate_stats``) combines three tools: a
``MemTracker`` (per-module memory), a ``RuntimeEstimator`` (per-module forward/backward times and the
module order) and a ``SACEstimator`` (per non-leaf module, the trade-off between the share of its
forward's memory discarded and the share of its forward's time recomputed). The two estimators time
kernels with CUDA events (or a roofline model of a CUDA device), so on CPU they stop; here their parts
come from our own measurements of the same step and ``aggregate_stats`` itself builds the ``ModuleInfo``.

Where each ``ModStats`` field comes from (``module_info``):

- ``param_per_module``, ``grad_per_module``, ``grad_total``, ``act_fw_per_module``,
  ``act_bw_per_module``, ``act_grad_per_module``, ``act_total``, ``input_per_module``,
  ``output_per_module``: PyTorch's ``MemTracker`` on the real step on CPU, run as PyTorch's own tests
  run it (two steps with the optimizer tracked, module statistics reset after the first).
- ``mod_order`` (forward and backward pre/post order): PyTorch's ``ModTracker`` hooks on one more
  forward and backward of the step (what ``RuntimeEstimator`` records).
- ``fw_runtime_per_module``: the sum, over the module's forward ops on our trace, of each op's median
  measured single-thread CPU time (``ForwardRecord.seconds``, in ms as PyTorch uses).
  ``bw_runtime_per_module``: not measured (NaN); ``sac_milp`` does not read it.
- ``sac_runtime``, ``sac_memory``, ``n_segments``, ``slopes``, ``intercepts``, ``breakpoints``,
  ``tradeoff_curve``: PyTorch's ``SACEstimator`` code (``_get_sac_stats``, ``_get_greedy_order_meta``,
  ``_get_sac_tradeoff_pwlf_stats`` through ``pwlf_sac_tradeoff_curve``) applied to per-op metadata we
  supply instead of its CUDA-timed dispatch: for every forward op of the module's subtree on our trace
  (in order), its measured time (ms), the bytes of the storages it allocates (for an in-place op, the
  bytes of the storage it writes, as ``SACEstimator`` counts them), whether it is view-like, random
  (``nondeterministic_seeded``) or in-place (its parent: the op that allocated the storage it writes,
  when that op is in the module) — the same tests ``SACEstimator`` applies to the same ops.
- ``is_leaf``: a module without children (``SACEstimator``'s rule).

``sac_milp`` then decides, per module, whether to checkpoint it and which share of its activation memory
to discard; its budget is in GiB (2^30 bytes) and its memory model is parameters + gradients +
activations, without optimizer state (``ilp_utils.get_peak_memory_runtime_baseline``: "Memory does not
include e.g., optimizer states"). Plans of whole-module checkpoints (discard ratio 1) of modules that are
our candidates are replayed on our traced ledger, so both are compared on the same clock.

A benchmark, not part of the library: it needs the ``sac`` extra (``pip install 'trainledger[sac]'``).

Run:  python benchmarks/torch_sac.py --model gpt-tiny [--budgets 8] [--json]
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import warnings
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

from trainledger.remat import ParetoResult, Planner, replay

SAC_REQUIREMENTS = ("pulp", "pwlf")
"""What PyTorch's SAC pipeline imports: ``sac_ilp`` needs ``pulp``, the trade-off fit needs ``pwlf``."""

GIB = 2**30


def sac_missing() -> tuple[str, ...]:
    """The packages PyTorch's SAC MILP needs that are not installed."""
    missing = []
    for name in SAC_REQUIREMENTS:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return tuple(missing)


@dataclass(frozen=True)
class SacPoint:
    """PyTorch's SAC MILP at one of our budgets."""

    budget_bytes: int
    """Our budget: the whole step's peak, optimizer state included."""
    milp_budget_bytes: int
    """The budget given to ``sac_milp`` (in bytes; it takes GiB)."""
    feasible: bool
    """``sac_milp`` found a solution (its peak is not -1)."""
    own_peak_bytes: int | None
    """The returned plan's peak by ``sac_milp``'s own memory model (params + grads + activations, no
    optimizer state), recomputed from its decisions with its own formulas (``a_i``, ``m_i``)."""
    recompute_ms: float | None
    """``sac_milp``'s objective: its predicted recomputation time (from our measured op times)."""
    decisions: dict[str, float]
    """Module path (ours, relative to the model) -> share of its activation memory to discard."""
    replayed_peak_bytes: int | None = None
    """The plan replayed on our traced ledger (full step, optimizer state included), where it can be."""
    replayed_extra_seconds: float | None = None
    """Measured time of the ops the replayed plan recomputes (our candidates' early-stopped prefix)."""
    why_not_replayed: str | None = None
    full_peak_bytes: int | None = None
    """Where the plan discards part of a module: every module it chose recomputed whole (discarding more
    than it asked for), replayed on our traced ledger."""
    full_extra_seconds: float | None = None
    """Measured time of the ops that whole-module version recomputes."""

    @property
    def within_budget(self) -> bool | None:
        if self.replayed_peak_bytes is None:
            return None
        return self.replayed_peak_bytes <= self.budget_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "milp_budget_bytes": self.milp_budget_bytes,
            "feasible": self.feasible,
            "own_peak_bytes": self.own_peak_bytes,
            "recompute_ms": self.recompute_ms,
            "decisions": dict(self.decisions),
            "replayed_peak_bytes": self.replayed_peak_bytes,
            "replayed_extra_seconds": self.replayed_extra_seconds,
            "within_budget": self.within_budget,
            "why_not_replayed": self.why_not_replayed,
            "full_peak_bytes": self.full_peak_bytes,
            "full_extra_seconds": self.full_extra_seconds,
        }


@dataclass(frozen=True)
class SacComparison:
    """PyTorch's SAC MILP over our budgets, beside our plain traced step.

    ``as_given``: ``sac_milp`` is given each budget as it is; ``less_optimizer``: the budget less the
    optimizer state its memory model leaves out (the fair question: does the rest fit?).
    """

    root: str
    """PyTorch's name for the model (its class name); module paths in ``decisions`` are ours."""
    baseline_peak_bytes: int
    """``get_peak_memory_runtime_baseline``: PyTorch's model of the plain step's peak."""
    memtracker_peak_bytes: int
    """``MemTracker``'s peak of the whole step (optimizer state included) on CPU."""
    optimizer_bytes: int
    """Optimizer state of the traced step (what ``sac_milp``'s memory model leaves out)."""
    as_given: tuple[SacPoint, ...]
    less_optimizer: tuple[SacPoint, ...]
    module_info: dict[str, Any] = field(repr=False)

    def summary(self, plain_peak_bytes: int) -> str:
        def count(points: tuple[SacPoint, ...]) -> str:
            return f"{sum(p.feasible for p in points)} of {len(points)}"

        return (
            f"ran on CPU (memory from MemTracker, times from our measured ops); its model of the plain step "
            f"peaks at {self.baseline_peak_bytes:,} bytes against our traced {plain_peak_bytes:,}: it leaves out "
            f"optimizer state ({self.optimizer_bytes:,} bytes here); budgets it calls feasible: {count(self.as_given)}"
            f" as given, {count(self.less_optimizer)} once the optimizer state is taken off the budget"
        )

    def to_dict(self) -> dict[str, Any]:
        pts = []  # for the picture: its plans (less optimizer state) on our trace, whole modules where partial
        for p in self.less_optimizer:
            if p.replayed_peak_bytes is not None and p.replayed_extra_seconds is not None:
                pts.append({"peak_bytes": p.replayed_peak_bytes, "extra_seconds": p.replayed_extra_seconds})
            elif p.full_peak_bytes is not None and p.full_extra_seconds is not None:
                pts.append({"peak_bytes": p.full_peak_bytes, "extra_seconds": p.full_extra_seconds})
        return {
            "ran": True,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "memtracker_peak_bytes": self.memtracker_peak_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "as_given": [p.to_dict() for p in self.as_given],
            "less_optimizer": [p.to_dict() for p in self.less_optimizer],
            "points": pts,
        }


# --- the ModuleInfo -----------------------------------------------------------------------------------


def _func(name: str) -> Any:
    """``aten.add.Tensor`` -> ``torch.ops.aten.add.Tensor``; a bare packet -> its ``default`` overload."""
    import torch

    obj: Any = torch.ops
    for part in name.split("."):
        obj = getattr(obj, part)
    if isinstance(obj, torch._ops.OpOverloadPacket):
        obj = obj.default
    return obj


def _in_subtree(module: str, path: str) -> bool:
    if path == "":
        return module == "(root)" or not module.startswith("(")
    return module == path or module.startswith(path + ".")


def _memtracker(planner: Planner) -> Any:
    """PyTorch's ``MemTracker`` on two real steps, statistics reset after the first (as its tests do)."""
    import copy

    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    from trainledger.workload import run_step

    w = planner.workload
    mt = MemTracker()
    mt.track_external(w.model, w.get_optimizer())
    last = None
    with mt:
        for it in range(2):

            def on_phase(phase: str, it: int = it) -> None:
                nonlocal last
                if phase == "optimizer" and it == 1:
                    last = mt.get_tracker_snapshot("current")

            run_step(w, on_phase=on_phase)
            if it == 0:
                mt.reset_mod_stats()
    for stats in mt.memory_tracking.values():  # modules whose inputs need no grad get no backward hooks
        for state in (_ModState.PRE_BW, _ModState.PEAK_BW, _ModState.POST_BW):
            if state not in stats.snapshots and last is not None:
                stats.snapshots.setdefault(state, []).append(copy.deepcopy(last))
    return mt


def _module_order(planner: Planner) -> tuple[dict[str, list[str]], Any]:
    """Forward/backward pre/post order by PyTorch's ``ModTracker`` on one forward and backward."""
    from torch.distributed._tools.mod_tracker import ModTracker

    from trainledger.workload import call_model, compute_loss

    w = planner.workload
    order: dict[str, list[str]] = {k: [] for k in ("fw_pre_order", "bw_pre_order", "fw_post_order", "bw_post_order")}
    tracker = ModTracker()
    tracker.register_user_hooks(
        pre_fw_hook=lambda mod, inp: order["fw_pre_order"].append(tracker.get_known_fqn(mod)),
        post_fw_hook=lambda mod, inp, out: order["fw_post_order"].append(tracker.get_known_fqn(mod)),
        pre_bw_hook=lambda mod, g: order["bw_pre_order"].append(tracker.get_known_fqn(mod)),
        post_bw_hook=lambda mod, g: order["bw_post_order"].append(tracker.get_known_fqn(mod)),
    )
    with tracker:
        loss = compute_loss(w, call_model(w.model, w.batch))
        loss.backward()
    w.get_optimizer().zero_grad(set_to_none=True)
    return order, tracker


def _sac_estimator(planner: Planner, root: str, non_leaf: dict[str, Any]) -> Any:
    """A ``SACEstimator`` whose per-module statistics come from our trace (see the module docstring)."""
    import torch
    from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP, SACEstimator, _SACMetadata
    from torch.testing._internal.composite_compliance import is_inplace, is_inplace_view_fn, is_view_fn

    from trainledger.ledger import Category

    plain, record = planner.plain, planner.record
    fwd = [e for e in plain.events if e.phase == "forward"]
    alloc_bytes: dict[int, int] = {}
    saved: set[int] = set()
    for e in plain.entries:
        if e.alloc_event is not None and e.alloc_event < len(fwd):
            alloc_bytes[e.alloc_event] = alloc_bytes.get(e.alloc_event, 0) + e.nbytes
            if e.category == Category.ACTIVATIONS:
                saved.add(e.alloc_event)
    est = SACEstimator()
    est._saved_tensor_ids = saved
    funcs = [_func(ev.op) for ev in fwd]
    for fqn in non_leaf:
        path = fqn[len(root) + 1 :] if fqn != root else ""
        idx = [ev.index for ev in fwd if _in_subtree(ev.module, path)]
        kept = [f for f in idx if funcs[f] not in OPS_TO_ALWAYS_SKIP]
        if not kept:
            continue
        members = set(kept)
        data = []
        for f in kept:
            func = funcs[f]
            inplace_info: tuple[int, ...] = ()
            out_ids: tuple[int, ...] = (f,) if f in alloc_bytes else ()
            nbytes = alloc_bytes.get(f, 0)
            if is_inplace(func):
                parent = next((a for a in record.inputs[f] if a in members), f)
                inplace_info = (f, parent)
                written = record.inputs[f][0] if record.inputs[f] else None
                out_ids = (written,) if written is not None else ()
                nbytes = alloc_bytes.get(written, 0) if written is not None else 0
            view = is_view_fn(func) or is_inplace_view_fn(func)
            rand = torch.Tag.nondeterministic_seeded in func.tags
            data.append(
                _SACMetadata(func, 1e3 * record.seconds[f], 0 if view else nbytes, f, out_ids, inplace_info, view, rand)
            )
        # force_store_random: a module called with no tensor inputs (SACEstimator._get_force_store_random)
        stats = est._get_sac_stats(data=data, force_store_random=False)
        est.sac_mod_stats[fqn] = stats
        est.sac_mod_greedy_order_meta[fqn] = est._get_greedy_order_meta(stats)
    return est


def module_info(planner: Planner) -> tuple[dict[str, Any], Any]:
    """PyTorch's ``ModuleInfo`` for the planner's workload, through PyTorch's own ``aggregate_stats``.

    Returns the module info and the ``MemTracker`` (for its peak). The model and optimizer are put back
    in the state the plain step was traced from.
    """
    import torch
    from torch.distributed._tools.ilp_utils import aggregate_stats

    try:
        order, tracker = _module_order(planner)
        mt = _memtracker(planner)
    finally:
        planner.restore()
    model = planner.workload.model
    root = type(model).__name__
    non_leaf = {}
    for name, mod in model.named_modules():
        fqn = f"{root}.{name}" if name else root
        if fqn in order["fw_pre_order"] and next(mod.children(), None) is not None:
            non_leaf[fqn] = mod
    est = _sac_estimator(planner, root, non_leaf)
    fwd = [e for e in planner.plain.events if e.phase == "forward"]
    runtimes: dict[str, dict[str, float]] = {}
    for fqn in order["fw_pre_order"]:
        path = fqn[len(root) + 1 :] if fqn != root else ""
        fw_ms = 1e3 * sum(planner.record.seconds[ev.index] for ev in fwd if _in_subtree(ev.module, path))
        runtimes[fqn] = {"fw": fw_ms, "bw": math.nan}
    rt = SimpleNamespace(
        mod_runtimes=runtimes,
        mod_fw_pre_order=order["fw_pre_order"],
        mod_bw_pre_order=order["bw_pre_order"],
        mod_fw_post_order=order["fw_post_order"],
        mod_bw_post_order=order["bw_post_order"],
    )
    info = aggregate_stats(model, mt, rt, est, torch.device(planner.plain.device or "cpu"))  # type: ignore[arg-type]
    return dict(info), mt


def sac_compare(planner: Planner, budgets: list[int]) -> SacComparison:
    """Run PyTorch's ``sac_milp`` at each budget (bytes) on the ``ModuleInfo`` of :func:`module_info`, once
    with the budget as it is and once less the optimizer state; needs ``pulp`` and ``pwlf``
    (:func:`sac_missing`). ``sac_compare(Planner.build(gpt_tiny()), [budget])`` is what ``pareto`` runs.
    """
    import copy

    from torch.distributed._tools.ilp_utils import get_peak_memory_runtime_baseline, parse_module_info
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY
    from torch.distributed._tools.sac_ilp import sac_milp

    from trainledger.ledger import Category

    info, mt = module_info(planner)
    root = type(planner.workload.model).__name__
    baseline, _ = get_peak_memory_runtime_baseline(parse_module_info(copy.deepcopy(info)))  # type: ignore[arg-type]
    peak = mt.get_tracker_snapshot("peak")
    mt_peak = int(sum(dev[_TOTAL_KEY] for dev in peak.values()))
    plain = planner.plain
    opt = sum(e.nbytes for e in plain.select(category=Category.OPTIMIZER))

    def run(b: int, given: int) -> SacPoint:
        graph = parse_module_info(copy.deepcopy(info))  # type: ignore[arg-type]
        fqn_decisions, recompute_ms, milp_peak = sac_milp(graph, memory_budget=given / GIB, world_size=1)
        if milp_peak == -1:
            return SacPoint(b, given, False, None, None, {})
        decisions = {(f[len(root) + 1 :] if f != root else "(root)"): float(r) for f, r in fqn_decisions.items()}
        own = own_peak_bytes(graph, fqn_decisions)
        return _replayed(planner, SacPoint(b, given, True, own, float(recompute_ms), decisions))

    log = logging.getLogger("torch.distributed._tools.sac_ilp")
    was = log.disabled
    log.disabled = True  # it logs an error for each infeasible budget; the result says so
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # pulp 3.x on sac_ilp's LpVariable.matrix
            as_given = tuple(run(b, b) for b in budgets)
            less = tuple(run(b, max(0, b - opt)) for b in budgets)
    finally:
        log.disabled = was
    return SacComparison(root, int(baseline), mt_peak, int(opt), as_given, less, info)


def own_peak_bytes(graph: Any, decisions: dict[str, float]) -> int:
    """The peak of a plan by ``sac_milp``'s own memory model, from its decisions (module fqn -> discard
    ratio): ``d_i = ACM_i r_i - (ACM_i - IA_i) y_i``, ``a_i = TA_i + AG_i - sum of d_j over the modules
    before i in forward post-order``, ``m_i = a_i + P_1 + TG_i`` (world size 1); the peak is ``max m_i``."""
    nodes = graph.nodes
    discarded: dict[str, float] = {}
    for n in nodes:
        r = decisions.get(n["fqn"])
        if r is None or n["is_leaf"]:
            continue
        acm, ia = float(n["sac_memory"]), float(n["act_fw_per_module"])
        acm = max(acm, ia)  # sac_milp overrides sac_memory with act_fw when it is smaller
        discarded[n["fqn"]] = acm * r - (acm - ia)
    p1 = nodes[0]["param_per_module"]
    peak = 0.0
    for n in nodes:
        before = graph.fw_post_order[: n["pos_fw_post_order"]]
        a = n["act_total"] + n["act_grad_per_module"] - sum(discarded.get(f, 0.0) for f in before)
        peak = max(peak, a + p1 + n["grad_total"])
    return round(peak)


def _replayed(planner: Planner, point: SacPoint) -> SacPoint:
    from dataclasses import replace

    cs = planner.candidates
    full = {c.region.path: j for j, c in enumerate(cs.candidates) if c.region.policy == "full"}
    missing = [p for p in point.decisions if p not in full]
    if missing:
        return replace(point, why_not_replayed="checkpoints " + ", ".join(missing) + ", not one of our candidates")
    chosen = [full[p] for p in point.decisions]
    partial = {p: r for p, r in point.decisions.items() if r < 1.0}
    if partial:
        return replace(
            point,
            why_not_replayed="discards part of "
            + ", ".join(f"{p} ({r:.0%})" for p, r in partial.items())
            + " (a per-op policy our plans do not express)",
            full_peak_bytes=replay(cs, chosen).peak().bytes,
            full_extra_seconds=sum(cs.candidates[j].seconds for j in chosen),
        )
    ledger = replay(cs, chosen)
    return replace(
        point,
        replayed_peak_bytes=ledger.peak().bytes,
        replayed_extra_seconds=sum(cs.candidates[j].seconds for j in chosen),
    )


def torch_sac_extra(planner: Planner, budgets: list[int]) -> dict[str, Any]:
    """PyTorch's SAC MILP at the same budgets, as ``ParetoResult.extra["torch_sac_ilp"]``, or why it did not run."""
    missing = sac_missing()
    if missing:
        return {"ran": False, "summary": "not run: pip install " + " ".join(missing)}
    comparison = sac_compare(planner, budgets)
    return {**comparison.to_dict(), "summary": comparison.summary(planner.plain_peak_bytes)}


def with_torch_sac(result: ParetoResult) -> ParetoResult:
    """``result`` (a sweep just run: it carries its planner) with PyTorch's SAC MILP at the same budgets."""
    from trainledger.commands.common import private_tmpdir

    assert result.planner is not None, "a sweep read back from JSON has no planner; run pareto() again"
    with private_tmpdir(prefix="trainledger-sac-"):  # the MILP solver's scratch files go with it
        sac = torch_sac_extra(result.planner, [r.budget_bytes for r in result.rows])
    return replace(result, extra={**result.extra, "torch_sac_ilp": sac})


def main(argv: list[str] | None = None) -> int:
    from trainledger.commands.common import print_json
    from trainledger.commands.pareto import render
    from trainledger.remat import pareto
    from trainledger.report.terminal import make_console
    from trainledger.sources import load_workload

    parser = argparse.ArgumentParser(description="trainledger pareto with PyTorch's SAC MILP at the same budgets")
    parser.add_argument("--model", default="gpt-tiny", help="a built-in example's name or file.py:factory")
    parser.add_argument("--budgets", type=int, default=8, help="number of budgets (default 8)")
    parser.add_argument("--json", action="store_true", help="print the sweep as JSON")
    args = parser.parse_args(argv)
    result = with_torch_sac(pareto(load_workload(args.model), num_budgets=args.budgets))
    if args.json:
        print_json(result.to_dict())
    else:
        render(result, make_console())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
