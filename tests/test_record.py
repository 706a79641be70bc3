"""``trainledger.record``: the user's own loop traced step by step, checked against the profiler's allocation
events (a separate process) and against the same loop run without it (bitwise)."""

from __future__ import annotations

import contextlib
import gc
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainledger
from tests import record_loop
from trainledger import Category, InputError, record
from trainledger.declared import RNG_STATE_ROLE
from trainledger.report.saved import open_saved

ROOT = Path(__file__).resolve().parent.parent


def state_of(run: dict[str, Any]) -> dict[str, Any]:
    """Everything the loop changes, as plain values to compare bitwise."""
    return {
        "model": run["model"].state_dict(),
        "opt": run["opt"].state_dict(),
        "sched": run["sched"].state_dict(),
        "scaler": run["scaler"].state_dict(),
        "rng": torch.get_rng_state(),
    }


def assert_bitwise(a: Any, b: Any, where: str = "") -> int:
    """Compare nested state; returns how many tensors were compared."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
        return 1
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        return sum(assert_bitwise(a[k], b[k], f"{where}.{k}") for k in a)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        return sum(assert_bitwise(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b, strict=True)))
    assert a == b, where
    return 0


def run_loop(recorded: bool, skip: int | None = None, **kwargs: Any) -> tuple[dict[str, Any], Any]:
    run = record_loop.build(skip=skip)
    rec = None
    if recorded:
        with record(run["model"], run["opt"], **kwargs) as rec:
            record_loop.train(**run)
    else:
        record_loop.train(**run)
    return state_of(run), rec


@pytest.mark.slow
@pytest.mark.parametrize("steps", [None, 2])
def test_training_is_bitwise_unchanged_by_recording(steps: int | None) -> None:
    plain, _ = run_loop(False)
    recorded, rec = run_loop(True, steps=steps)
    assert rec.steps == (tuple(range(record_loop.NUM_STEPS)) if steps is None else (2,))
    assert assert_bitwise(plain, recorded) > 10  # weights, moments, steps, scaler's scale, RNG


def test_a_small_loop_is_bitwise_unchanged() -> None:
    def loop(recorded: bool) -> dict[str, Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 1))
        opt = torch.optim.AdamW(model.parameters())
        with record(model, opt, steps=1) if recorded else contextlib.nullcontext():
            for _ in range(3):
                model(torch.randn(4, 8)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        return {"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state()}

    assert assert_bitwise(loop(False), loop(True)) == 4 + 4 * 3 + 1


def test_the_generator_states_checkpointing_keeps_are_recorded_and_training_is_unchanged() -> None:
    """Each checkpointed call keeps a copy of the CPU generator's state (5,056 bytes) until its backward: the
    ledger lists one per call, and a loop with dropout inside a checkpoint trains bitwise as without record."""
    plain = record_loop.build(checkpointed=True)
    record_loop.train(**plain)
    run = record_loop.build(checkpointed=True)
    with record(run["model"], run["opt"], steps=1) as rec:
        record_loop.train(**run)
    assert assert_bitwise(state_of(plain), state_of(run)) > 10
    led = rec.ledger(step=1)
    states = [e for e in led.entries if e.role == RNG_STATE_ROLE]
    assert {e.nbytes for e in states} == {torch.get_rng_state().numel()} and all(e.free_event for e in states)
    # per micro-batch, each of the two checkpointed calls copies the state as it runs forward, and its
    # recomputation in backward copies it again (``fork_rng`` keeps the state it restores after)
    phases = [led.events[e.alloc_event].phase for e in states]
    assert phases.count("forward") == phases.count("backward") == 2 * record_loop.ACCUMULATION


def test_a_compiled_function_that_ran_eagerly_is_said_as_it_runs_and_in_the_ledger() -> None:
    """dynamo does not run under record's dispatch mode: a compiled module record runs compiled, but a compiled
    function (``torch.compile(fn)``, ``torch.compile(opt.step)``) ran eagerly, silently changing training."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    forward = torch.compile(lambda x: model(x), backend="eager")
    with pytest.warns(UserWarning, match="a function compiled with torch.compile"), record(model, opt, steps=1) as rec:
        for _ in range(3):
            forward(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    notes = [n for n in rec.ledger(step=1).notes if "function compiled with torch.compile" in n]
    assert len(notes) == 1 and notes[0].startswith("1 call(s)")


def test_lbfgs_history_made_in_a_recorded_step_is_optimizer_state() -> None:
    """L-BFGS's lists of directions and steps, those from earlier steps and those the step appends: what is
    alive in the optimizer category as the step ends is every state tensor the optimizer holds, by hand."""
    model, opt, closure = record_loop.lbfgs()
    with record(model, opt, steps=1) as rec:
        for _ in range(2):
            opt.step(closure)
    state = opt.state[model.weight]
    held = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for v in state.values()
        for t in (v if isinstance(v, list) else [v])
        if torch.is_tensor(t)
    }
    led = rec.ledger(step=1)
    alive = [e for e in led.entries if e.free_event is None and e.category == Category.OPTIMIZER]
    assert sum(e.nbytes for e in alive) == sum(held.values()) and len(held) > 10
    assert not [e for e in led.entries if e.free_event is None and e.role == "optimizer_temporary"]


def loop_peaks(mode: str, *options: str) -> list[int]:
    """Per-step peaks of ``tests.record_loop`` in a fresh process: the profiler's (``oracle``) or record's."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.record_loop", mode, *options],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "options", [[], ["--skip", "1"], ["--checkpoint"]], ids=["every-step", "step-1-skipped", "checkpointed"]
)
def test_recorded_peaks_equal_the_allocators_within_a_tenth_of_a_percent(options: list[str]) -> None:
    oracle, traced = loop_peaks("oracle", *options), loop_peaks("record", *options)
    assert len(oracle) == len(traced) == record_loop.NUM_STEPS
    for step, (o, t) in enumerate(zip(oracle, traced, strict=True)):
        assert abs(t - o) <= 0.001 * o, (step, o, t)


@pytest.mark.slow
def test_a_step_the_grad_scaler_skips_is_its_own_step() -> None:
    plain, _ = run_loop(False, skip=1)
    recorded, rec = run_loop(True, skip=1)
    assert assert_bitwise(plain, recorded) > 10
    assert recorded["opt"]["state"][0]["step"].item() == record_loop.NUM_STEPS - 1  # one step was skipped
    assert rec.steps == tuple(range(record_loop.NUM_STEPS))
    assert [rec.ledger(step=k).meta.get("skipped", False) for k in rec.steps] == [False, True, False, False]
    skipped = rec.ledger(step=1)
    assert any("skipped optimizer.step()" in n for n in skipped.notes)
    # forward and backward of all four micro-batches, the unscale, and no optimizer state made or changed
    assert len([c for c in skipped.calls if c.path == "(root)"]) == record_loop.ACCUMULATION
    assert {"forward", "backward", "optimizer"} <= {ev.phase for ev in skipped.events}
    assert not [e for e in skipped.select(category=Category.OPTIMIZER) if e.alloc_event is not None]
    assert {e.name for e in skipped.select(category=Category.GRADIENTS)} >= {"0.weight.grad", "5.bias.grad"}


def test_optimizer_state_made_in_a_recorded_step_is_named_as_trace_names_it() -> None:
    """AdamW makes its state on the first step; its step counters (``torch.tensor(0.0)``) without an op. Each
    recorded step names every state tensor as ``trace`` does, by its parameter; on the first step each is
    allocated then, for its parameter."""
    from trainledger.examples import gpt_tiny
    from trainledger.trace import trace
    from trainledger.workload import run_step

    w = gpt_tiny(n_layer=1, n_embd=8, n_head=2, seq_len=4, batch_size=1)
    with record(w.model, w.get_optimizer()) as rec:
        for _ in range(2):
            run_step(w)
    traced = trace(w)
    state = sorted((e.name, e.role, e.nbytes) for e in traced.select(category=Category.OPTIMIZER))
    num_params = len(list(w.model.parameters()))
    assert len(state) == 3 * num_params  # exp_avg, exp_avg_sq, step
    for step in rec.steps:
        led = rec.ledger(step=step)
        assert sorted((e.name, e.role, e.nbytes) for e in led.select(category=Category.OPTIMIZER)) == state
        assert not [e.name for e in led.entries if e.role == "captured"]
    made = rec.ledger(step=0).select(category=Category.OPTIMIZER)
    assert all(e.alloc_event is not None and e.name == f"optimizer.{e.owner}.{e.role}" for e in made)


@pytest.mark.slow
def test_phases_accumulation_and_categories() -> None:
    _, rec = run_loop(True, steps=1)
    led = rec.ledger(step=1)
    assert led.meta["step"] == 1 and led.meta["recorded"] is True
    phases = [ev.phase for ev in led.events]
    assert {"forward", "backward", "optimizer"} <= set(phases)
    # four micro-batches: four calls of the model, each with its backward
    roots = [c for c in led.calls if c.path == "(root)"]
    assert len(roots) == record_loop.ACCUMULATION and all(c.backward_start is not None for c in roots)
    # gradients are made by the first micro-batch's backward and persist until zero_grad
    # (the last step's, alive as the step begins, go at its zero_grad, before the first forward)
    grads = led.select(category=Category.GRADIENTS)
    names = {n + ".grad" for n, p in record_loop.build()["model"].named_parameters()}
    old, new = [g for g in grads if g.alloc_event is None], [g for g in grads if g.alloc_event is not None]
    assert {g.name for g in old} == {g.name for g in new} == names
    first_forward, first_backward = phases.index("forward"), phases.index("backward")
    last_forward = len(phases) - 1 - phases[::-1].index("forward")
    assert all(g.free_event is not None and g.free_event <= first_forward for g in old)
    assert all(first_backward <= g.alloc_event < last_forward and g.free_event is None for g in new)
    assert led.select(category=Category.ACTIVATIONS) and led.select(category=Category.OPTIMIZER)
    assert rec.peak() == max((rec.ledger(step=k).peak() for k in rec.steps), key=lambda p: p.bytes)


@pytest.mark.slow
def test_save_writes_a_ledger_the_report_command_reads(tmp_path: Path) -> None:
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with record(model, opt) as rec:
        for _ in range(2):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    path = rec.save(tmp_path / "run" / "step.json", step=1)
    saved = open_saved(path).result
    assert saved.peak() == rec.ledger(step=1).peak()
    html = tmp_path / "step.html"
    out = subprocess.run(
        [sys.executable, "-m", "trainledger.cli", "report", str(path), "--html", str(html)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert html.stat().st_size > 1000


def test_decorator_several_optimizers_and_save_on_cpu() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    first = torch.optim.Adam(model[0].parameters())
    second = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
    rec = trainledger.record(model, first, second)

    @rec
    def train() -> None:
        for _ in range(3):
            with torch.autograd.graph.save_on_cpu():
                loss = model(torch.randn(16, 8)).square().mean()
            loss.backward()
            first.step()
            second.step()  # the step ends once both have stepped
            first.zero_grad()
            second.zero_grad()

    train()
    assert rec.steps == (0, 1, 2)
    led = rec.ledger(step=2)
    # save_on_cpu's copies are held for backward: activations, though autograd's hooks were the user's
    held = [e for e in led.select(category=Category.ACTIVATIONS) if e.role == "held_for_backward"]
    assert held and all(e.free_event is not None for e in held)
    assert {"exp_avg", "exp_avg_sq", "momentum_buffer"} <= {e.role for e in led.select(category=Category.OPTIMIZER)}


def test_steps_count_on_across_entries_and_an_evaluation_after_the_last_is_no_step() -> None:
    """A step is what ends in optimizer.step(): the decorated loop called twice numbers its steps 0..3, an
    evaluation's forward after the last step is not recorded, and a step that reached backward is."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = record(model, opt)

    @rec
    def train(evaluate: bool) -> None:
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        if evaluate:
            with torch.no_grad():
                model(torch.randn(3, 4))

    train(evaluate=True)
    train(evaluate=False)
    assert rec.steps == (0, 1, 2, 3)
    assert all(rec.ledger(step=k).events[-1].phase == "optimizer" for k in rec.steps)
    with rec:  # a loop that leaves after backward: the step it began is recorded, as the next index
        model(torch.randn(3, 4)).sum().backward()
    assert rec.steps == (0, 1, 2, 3, 4) and rec.ledger(step=4).events[-1].phase == "backward"
    opt.zero_grad()


def test_bad_input_says_how_to_fix_it() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InputError, match="model first"):
        record(opt, opt)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="needs the optimizer"):
        record(model)
    with pytest.raises(InputError, match="steps"):
        record(model, opt, steps=-1)
    with record(model, opt, steps=[5]) as rec:
        model(torch.randn(1, 2)).sum().backward()
        opt.step()
    with pytest.raises(InputError, match="no step was recorded"):
        rec.ledger()
    with record(model, opt) as rec:
        model(torch.randn(1, 2)).sum().backward()
        opt.step()
    with pytest.raises(InputError, match=r"recorded steps: \[0\]"):
        rec.ledger(step=3)
    with pytest.raises(InputError, match="'cuda' names none of the devices the step's arrays are on: cpu"):
        rec.ledger(device="cuda")  # a device the step never used is no empty ledger, nor the CPU's
    assert rec.ledger(device=torch.device("cpu")).peak() == rec.ledger().peak()
    for bad in (5, None):
        with pytest.raises(InputError, match="the path to save to is"):
            rec.save(bad)  # type: ignore[arg-type]
    for step in (True, 0.0):  # keys equal to 0, not a step index
        with pytest.raises(InputError, match=r"was not recorded; recorded steps: \[0\]"):
            rec.ledger(step=step)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="names the ledgers: give a string, not an int 3"):
        record(model, opt, name=3)  # type: ignore[arg-type]


class _Lookahead(torch.optim.Optimizer):
    """A wrapper as many published ones are: an Optimizer subclass that never runs ``Optimizer.__init__``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults

    def step(self, closure: Any = None) -> Any:
        return self.optimizer.step(closure)


def test_an_entry_that_fails_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrapper optimizer without step hooks is refused as record() is called, naming what to give instead;
    and an entry that fails part-way (here as the first step opens) undoes what it had done: the model's
    hook, the optimizers' hooks, the GradScaler's watch, the running flag."""
    from trainledger.record import _loop

    model = nn.Linear(3, 2)
    inner = torch.optim.Adam(model.parameters())
    with pytest.raises(InputError, match=r"without running Optimizer.__init__.*record\(model, opt.optimizer\)"):
        record(model, _Lookahead(inner))
    scaler_step = torch.amp.GradScaler._maybe_opt_step

    def fails(_self: Any) -> None:
        raise RuntimeError("the step could not open")

    rec = record(model, inner)
    monkeypatch.setattr(_loop.Recording, "_open", fails)
    with pytest.raises(RuntimeError, match="could not open"), rec:
        pass
    assert not rec.running and not model._forward_pre_hooks
    assert not inner._optimizer_step_pre_hooks and not inner._optimizer_step_post_hooks
    assert torch.amp.GradScaler._maybe_opt_step is scaler_step
    monkeypatch.undo()
    with rec:  # entered again, it records
        model(torch.randn(4, 3)).square().mean().backward()
        inner.step()
    assert rec.steps == (0,)


def test_an_error_in_the_loop_leaves_nothing_behind() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="boom"), record(model, opt) as rec:
        model(torch.randn(1, 2)).sum().backward()
        raise RuntimeError("boom")
    assert _get_current_dispatch_mode() is None and not rec.running
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert rec.steps == ()


class _OwnMode(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_step_ended_under_another_mode_or_a_second_record_leaves_nothing_behind() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InputError, match="inside another dispatch mode"), record(model, opt), _OwnMode():
        model(torch.randn(1, 2)).sum().backward()
        opt.step()
    assert _get_current_dispatch_mode() is None  # the tracer does not stay on for the rest of the process
    with pytest.raises(InputError, match="another record"), record(model, opt), record(model, opt):
        raise AssertionError("entering the second record raises before this line")
    assert _get_current_dispatch_mode() is None
    with record(model, opt) as rec:  # and the next record runs as usual
        model(torch.randn(1, 2)).sum().backward()
        opt.step()
    assert rec.steps == (0,)
    with pytest.raises(InputError, match="same optimizer twice"):
        record(model, opt, opt)


def test_the_loss_a_closure_computes_is_forward() -> None:
    """Lightning's automatic loop runs forward and backward inside optimizer.step(closure)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(3, 4), torch.randn(3, 1)

    def closure() -> torch.Tensor:
        loss = (model(x) - y).pow(2).mean()  # outside every module
        loss.backward()
        return loss

    with record(model, opt) as rec:
        opt.step(closure)
    led = rec.ledger()
    ops = [(ev.op, ev.phase) for ev in led.events]
    assert ("aten.mean", "forward") in ops and ("aten.sub.Tensor", "forward") in ops
    assert ops[-1][1] == "optimizer" and any(phase == "backward" for _, phase in ops)


def test_steps_never_reached_and_files_save_cannot_write_say_so(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record(model, opt, steps=[10]) as rec:
        for _ in range(2):
            model(torch.randn(1, 2)).sum().backward()
            opt.step()
    with pytest.raises(InputError, match=r"steps=\[10\] asked for steps the loop never reached \(2 ended"):
        rec.ledger()
    with record(model, opt) as rec:
        model(torch.randn(1, 2)).sum().backward()
        opt.step()
    with pytest.raises(InputError, match=r"give a \.json name"):
        rec.save(tmp_path / "step.html")
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError, match="cannot write"):
        rec.save(tmp_path / "file" / "step.json")  # a file where a folder must be


def compiled_loop(recorded: bool, backend: str = "inductor") -> tuple[dict[str, Any], Any]:
    """Three steps of a compiled model with dropout and AdamW (compiled before record, as a script does)."""
    torch._dynamo.reset()
    gc.collect()  # the last loop's tensors would count as held by this one
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters())
    step_model = torch.compile(model, backend=backend)
    rec = record(model, opt) if recorded else None
    with rec if rec is not None else contextlib.nullcontext():
        for _ in range(3):
            step_model(torch.randn(8, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return {"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state()}, rec


# importing inductor imports torch.jit's deprecated script_method
INDUCTOR_IMPORT = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


@pytest.mark.slow
@INDUCTOR_IMPORT
def test_an_inductor_compiled_model_trains_bitwise_unchanged_and_its_calls_are_measured() -> None:
    pytest.importorskip("torch._inductor")
    plain, _ = compiled_loop(recorded=False)
    recorded, rec = compiled_loop(recorded=True)
    # inductor's dropout draws other numbers than eager's: equal only because the traced steps ran compiled
    assert assert_bitwise(plain, recorded) == 4 + 4 * 3 + 1
    assert rec.steps == (0, 1, 2)
    for k in rec.steps:
        led = rec.ledger(step=k)
        assert any("ran compiled, as without record" in n for n in led.notes)
        ops = [(e.phase, e.op) for e in led.events]
        assert ("forward", "compiled:(root)") in ops and ("backward", "compiled:(root).backward") in ops
        assert not any(op in {"aten.addmm", "aten.gelu", "aten.mm"} for _, op in ops)  # no eager op inside
        inside = [e for e in led.entries if e.role == "compiled_internal"]
        assert inside and all(e.evidence.value == "measured" and e.nbytes > 0 for e in inside)
        # the compiled forward's saved tensors are traced: activations from its event until its backward
        fwd, bwd = (ops.index(op) for op in (("forward", "compiled:(root)"), ("backward", "compiled:(root).backward")))
        saved = [e for e in led.entries if e.name.startswith("compiled:(root)#") and e.category == Category.ACTIVATIONS]
        assert saved and all(e.alloc_event == fwd and e.free_event and e.free_event <= bwd + 1 for e in saved)
        grads = [e for e in led.entries if e.category == Category.GRADIENTS and e.alloc_event == bwd]
        assert sum(e.nbytes for e in grads) == sum(p.numel() * 4 for p in rec.model.parameters())


@pytest.mark.slow
@INDUCTOR_IMPORT
def test_a_compiled_model_recorded_peaks_equal_the_profilers_within_half_a_percent() -> None:
    pytest.importorskip("torch._inductor")
    oracle, traced = loop_peaks("oracle", "--compile"), loop_peaks("record", "--compile")
    assert len(oracle) == len(traced) == record_loop.NUM_STEPS
    for step, (o, t) in enumerate(zip(oracle, traced, strict=True)):
        # record's post-hook on the compiled backward keeps its incoming gradient alive until it returns (the
        # logits' gradient here: 512 B of 181 kB)
        assert abs(t - o) <= 0.005 * o, (step, o, t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_compiled_call_on_cuda_is_measured_by_the_allocators_peak() -> None:
    from trainledger.record._compiled import _cuda_peak

    device = torch.device("cuda")
    keep = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    with _cuda_peak(device) as peak:
        a = torch.empty(3 << 20, dtype=torch.uint8, device=device)
        b = torch.empty(2 << 20, dtype=torch.uint8, device=device)
        del a, b
    assert peak() == 5 << 20 and keep.numel() == 1 << 20


def test_compiled_modules_are_found_however_compiled() -> None:
    from trainledger.record._compiled import compiled_modules

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    assert compiled_modules(model) == []
    model[1].compile(backend="eager")  # compiles lazily, on the first call
    wrapper = torch.compile(model[0], backend="eager")
    assert compiled_modules(model) == ["0", "1"]
    del wrapper
    assert compiled_modules(model) == ["1"]


def test_a_validation_loss_outside_no_grad_is_freed_each_step() -> None:
    """A loss computed for its value only (``.item()``, no ``no_grad``) builds a graph that no backward runs: the
    saved-tensor hooks kept it alive (a cycle through its tanh node), so each recorded step held every earlier
    step's graph as ``held_by_loop`` (+1,024 bytes a step here) and the tensors outlived the loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(5)]
    held = torch.randn(8, 16)
    gc.collect()
    before = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))
    with record(model, opt) as rec:
        for x, y in data:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            validation = torch.nn.functional.mse_loss(model(held), y).item()  # noqa: F841
    peaks = [rec.ledger(step=s).peak().bytes for s in rec.steps[1:-1]]
    assert len(peaks) >= 3 and len(set(peaks)) == 1, peaks
    del rec
    gc.collect()
    assert sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor)) == before


def test_what_the_loop_prepares_before_each_micro_batch_is_the_steps_input() -> None:
    """Targets the loss reads and a mask, made by the loop before each micro-batch's forward, are the step's
    inputs (role ``loop_input``): they were workspace of ``zero_grad`` before the first micro-batch and of the
    optimizer before the second. A temporary the loop frees before forward (clipping's) stays workspace."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data, labels = torch.randn(40, 6), torch.randint(0, 3, (40,))
    with record(model, opt, steps=1) as rec:
        for step in range(2):
            for micro in range(2):
                rows = slice(20 * step + 10 * micro, 20 * step + 10 * (micro + 1))
                x, y = data[rows].clone(), labels[rows].clone()
                keep = (y >= 0).to(torch.float32)  # a mask: 10 floats
                loss = (nn.functional.cross_entropy(model(x), y, reduction="none") * keep).mean()
                loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    led = rec.ledger(step=1)
    prepared = [e for e in led.entries if e.role == "loop_input"]
    assert sorted(e.nbytes for e in prepared) == [40, 40, 80, 80]  # a mask and int64 targets per micro-batch
    assert {e.category for e in prepared} == {Category.INPUTS}
    assert [e.nbytes for e in led.entries if e.role == "batch"] == [240, 240]
    forward = [ev.index for ev in led.events if ev.phase == "forward"]
    assert all(e.alloc_event < forward[-1] for e in prepared)
    clipping = [e for e in led.entries if e.category == Category.WORKSPACE and e.role == "optimizer_temporary"]
    assert clipping and all(e.free_event is not None for e in clipping)


def _encoder_run(recorded: bool) -> tuple[dict[str, Any], Any]:
    """Two steps of an ``nn.TransformerEncoder`` with a padding mask, each followed by a validation forward, whose
    fast path (eval, no_grad, a mask) packs the batch into a nested tensor; and a nested tensor held by the loop."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=12, nhead=2, dim_feedforward=20, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True)
    opt = torch.optim.AdamW(model.parameters())
    x, mask = torch.randn(3, 5, 12), torch.zeros(3, 5, dtype=torch.bool)
    mask[:, 3:] = True
    held = torch.nested.nested_tensor([torch.ones(2, 7), torch.ones(3, 7)], dtype=torch.float64)  # 35 in one buffer
    losses = []
    with record(model, opt) if recorded else contextlib.nullcontext() as rec:
        for _ in range(2):
            model.train()
            model(x, src_key_padding_mask=mask).square().mean().backward()
            opt.step()
            opt.zero_grad()
            model.eval()
            with torch.no_grad():
                losses.append(model(x, src_key_padding_mask=mask).square().mean())
    del held
    return {"model": model.state_dict(), "opt": opt.state_dict(), "losses": losses, "rng": torch.get_rng_state()}, rec


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_tensors_in_the_step_and_held_by_the_loop_are_recorded_and_training_is_unchanged() -> None:
    """A nested tensor has no shape (reading it raised inside the tracer, out of the user's loop): it is
    recorded by its buffer."""
    plain, _ = _encoder_run(False)
    recorded, rec = _encoder_run(True)
    assert assert_bitwise(plain, recorded) > 10
    held = [e for e in rec.ledger(step=0).entries if e.role == "held" and e.dtype == "float64"]
    assert [(e.shape, e.nbytes) for e in held] == [((35,), 280)]
    assert rec.steps == (0, 1)


def test_a_profiler_of_the_users_around_record_keeps_its_events() -> None:
    """Measuring the buffers a convolution allocates inside its op starts a profiler, which ended the user's and
    lost what it had recorded (profilers do not nest). Under the user's profiler they are left out, and the
    ledger says so."""
    from torch.profiler import ProfilerActivity, profile

    from trainledger.trace import CALLERS_PROFILER_NOTE

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(24, 1))
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(2, 3, 8)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, record(model, opt) as rec:
        for _ in range(2):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    ops = [e.name() for e in prof.profiler.kineto_results.events()]
    assert ops.count("aten::convolution") >= 2  # both steps' convolutions, in the user's profile
    assert all(CALLERS_PROFILER_NOTE in rec.ledger(step=k).notes for k in rec.steps)


def test_what_a_module_around_the_model_makes_is_not_the_loops_input() -> None:
    """DDP's wrapper makes its gradient buckets in its forward, before it calls the recorded model: they are
    not what the loop prepared (they were named ``loop_input``); the targets the loop made before are."""

    class Wrapper(nn.Module):  # as DistributedDataParallel does: buckets made, then the module called
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner
            self.bucket: torch.Tensor | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.bucket is None:
                self.bucket = torch.zeros(sum(p.numel() for p in self.inner.parameters()))
            return self.inner(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    wrapped = Wrapper(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record(model, opt) as rec:
        y = torch.randint(0, 3, (4,))
        nn.functional.cross_entropy(wrapped(torch.randn(4, 5)), y).backward()
        opt.step()
    led = rec.ledger(step=0)
    bucket = 4 * sum(p.numel() for p in model.parameters())
    assert [e.nbytes for e in led.entries if e.role == "loop_input"] == [32]  # the int64 targets
    assert [e.category for e in led.entries if e.nbytes == bucket and e.alloc_event is not None] == [Category.WORKSPACE]


def test_an_optimizer_of_another_model_is_said() -> None:
    model, other = nn.Linear(4, 2), nn.Linear(4, 2)
    with pytest.warns(UserWarning, match=r"the SGD given to record\(\) trains none of Linear's parameters"):
        record(model, torch.optim.SGD(other.parameters(), lr=0.1))


def test_a_batch_held_before_the_step_and_a_container_called_by_parts_name_the_step_inputs() -> None:
    """A batch the loop holds from before the step (a dataset in memory) is the step's input once the model is
    called with it, not a tensor the loop holds; a container the loop never calls (a GAN's generator and
    discriminator in a ModuleDict) marks what the loop hands its modules, not what one module hands the other."""
    torch.manual_seed(0)
    nets = nn.ModuleDict({"g": nn.Linear(8, 16), "d": nn.Linear(16, 1)})
    opt_g = torch.optim.Adam(nets["g"].parameters())
    opt_d = torch.optim.Adam(nets["d"].parameters())
    real = [torch.randn(32, 16) for _ in range(3)]
    with record(nets, opt_g, opt_d, steps=[1]) as rec:
        for x in real:
            z = torch.randn(32, 8)
            fake = nets["g"](z)
            loss_d = nets["d"](x).mean() - nets["d"](fake.detach()).mean()
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            loss_g = -nets["d"](fake).mean()
            opt_g.zero_grad()
            loss_g.backward()
            opt_g.step()
    led = rec.ledger(step=1)
    inputs = {(e.name, e.nbytes) for e in led.select(category=Category.INPUTS)}
    assert sorted(n for _, n in inputs) == [32 * 8 * 4, 32 * 16 * 4]  # the noise made in the step, the held batch
    held = [e for e in led.entries if e.role == "held" and e.shape == (32, 16) and e.free_event is None]
    assert len(held) == 2  # the other steps' batches (the last step's generated batch goes as it is replaced)
    fakes = [e for e in led.entries if e.nbytes == 32 * 16 * 4 and e.alloc_event is not None]
    assert fakes and all(e.category != Category.INPUTS for e in fakes)  # the generator's output is not an input


def test_an_evaluation_between_steps_is_said_in_the_next_steps_notes() -> None:
    """What runs after ``optimizer.step()`` opens the next step, so an evaluation there is that step's forward
    (its peak may be the evaluation's): the step's notes say the model ran under no_grad, and how often."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record(model, opt) as rec:
        for _ in range(3):
            loss = model(torch.randn(4, 8)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                model(torch.randn(256, 8))
    said = [[n for n in rec.ledger(step=k).notes if "under no_grad" in n] for k in rec.steps]
    assert said[0] == [] and all(len(s) == 1 and "ran 1 time under no_grad" in s[0] for s in said[1:])
    assert rec.ledger(step=1).peak().phase == "forward"  # the evaluation's batch is 64 times the step's
