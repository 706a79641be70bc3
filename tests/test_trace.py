"""The tracer against independent oracles: the profiler's allocation events, fake vs real, hand counts."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from tests.conftest import traced_example
from trainledger import examples
from trainledger.errors import InputError
from trainledger.ledger import LOSS_SCOPE, Category, Evidence
from trainledger.trace import KERNEL_INTERNAL, active_tracer, trace
from trainledger.workload import Workload


def profiler_peak(name: str) -> int:
    out = subprocess.run(
        [sys.executable, "-m", "tests.oracle_profiler", name], capture_output=True, text=True, check=True, timeout=300
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "lora", "seed-423", "moe", "cnn", "lstm", "unet-small"])
def test_traced_peak_equals_the_profilers_allocation_count(name):
    # Tensor storages, plus the buffers convolution, BatchNorm and LSTM kernels hold inside one op (measured
    # by running each kernel alone): the trace must be exact.
    assert traced_example(name).peak().bytes == profiler_peak(name)


@pytest.mark.slow
def test_kernel_buffers_are_what_a_tensor_trace_misses_on_a_conv_net():
    led = traced_example("unet-small")
    tensors_only = trace(examples.build("unet-small"), kernel_workspace=False)
    internal = [e for e in led.entries if e.role == KERNEL_INTERNAL]
    assert internal and all(e.evidence == Evidence.MEASURED and e.free_event == e.alloc_event + 1 for e in internal)
    assert {led.events[e.alloc_event].op for e in internal} >= {"aten.convolution", "aten.convolution_backward"}
    assert led.peak().bytes > tensors_only.peak().bytes  # the peak sits inside a convolution's backward
    assert [e for e in led.entries if e.role != KERNEL_INTERNAL] == list(tensors_only.entries)
    assert "kernel_internal" in led.notes[0] and "excluded: memory kernels allocate" in tensors_only.notes[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt-tiny", "dpo"])
def test_unprobed_kernel_buffers_are_small_and_measured(name):
    # A few bytes of Python scalars wrapped as tensors inside kernels remain unseen; measured mode sees them.
    from trainledger.measure import measure

    traced = traced_example(name).peak().bytes
    oracle = profiler_peak(name)
    assert 0 <= oracle - traced <= 512
    m = measure(examples.build(name), num_steps=1)
    assert m.peak_bytes == oracle
    assert m.unseen_workspace_bytes == oracle - traced


def test_the_profilers_warning_on_older_storage_does_not_fail_a_measured_step(monkeypatch):
    """Under warnings as errors, the profiler's warning when the measured step frees storage allocated before it
    started (the step's own call of ``warnings.warn``, as torch's handler passes it on) is ignored there; any
    other warning still raises, and after the step that one raises too."""
    import importlib
    import warnings

    measure_module = importlib.import_module("trainledger.measure")  # the package, not the function it exports
    plain = measure_module.run_step
    message = "Memory block of unknown size was allocated before the profiling started"  # CPUAllocator.cpp

    def step(workload, **kwargs):
        if torch.autograd.profiler._is_profiler_enabled:  # the measured step: under the profiler
            warnings.warn(message, UserWarning, stacklevel=1)
        return plain(workload, **kwargs)

    monkeypatch.setattr(measure_module, "run_step", step)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = measure_module.measure(examples.mlp(), num_steps=1)
        assert m.peak_bytes >= m.traced.peak().bytes - 64
        with pytest.raises(UserWarning, match="unknown size"):
            warnings.warn(message, UserWarning, stacklevel=1)  # outside the measured step it is not ignored
        message = "another warning in the measured step"
        with pytest.raises(UserWarning, match="another warning"):
            measure_module.measure(examples.mlp(), num_steps=1)


def test_measured_step_times_name_their_spread_and_threads_and_the_profiler_stays_quiet(capfd):
    from trainledger.measure import measure

    threads = torch.get_num_threads()
    m = measure(examples.mlp(), num_steps=3)
    fastest, median, slowest = m.step_spread_seconds
    assert len(m.step_seconds) == 3 and fastest <= median <= slowest and m.step_threads == 1
    assert torch.get_num_threads() == threads  # restored
    d = m.to_dict()
    assert d["min_step_seconds"] == fastest and d["max_step_seconds"] == slowest
    assert "USDT" not in capfd.readouterr().err  # the profiler's native trace lines are filtered out


# lora and seed-423 train with mse_loss, whose CPU kernel returns its scalar in an input-sized storage:
# the fake trace sizes it by running the kernel (and says so)
FAKEABLE_EXACT = ["gpt-tiny", "mlp", "cnn", "dpo", "autocast-bf16", "bf16-master", "lora", "seed-423"]


def _signature(led):
    events = [(e.index, e.phase, e.op, e.module) for e in led.events]
    entries = sorted(
        (str(x.category), x.role, x.dtype, x.nbytes, x.alloc_event or -1, x.free_event or -1, x.name)
        for x in led.entries
    )
    return events, entries


@pytest.mark.parametrize("name", FAKEABLE_EXACT)
def test_fake_trace_is_identical_event_by_event(name):
    real = traced_example(name)
    fake = trace(examples.build(name), fake=True)
    assert _signature(real) == _signature(fake)
    assert fake.meta["fake"] is True
    assert ("mse_loss" in " ".join(fake.notes)) == (name in ("lora", "seed-423"))


def test_a_fake_lstm_trace_says_which_kernel_buffers_it_could_not_size():
    real = trace(examples.build("lstm"))
    fake = trace(examples.build("lstm"), fake=True)
    # the LSTM's workspace is sized by running its forward kernel; its backward reads that workspace, which
    # fake tensors cannot hold, so the backward's own buffers are left out and counted in the notes
    workspace = [e for e in fake.entries if e.name.startswith("aten.mkldnn_rnn_layer#") and e.shape == (0,)]
    assert workspace and all(e.nbytes > 0 for e in workspace)
    assert "2 kernel calls that could not be run here" in fake.notes[0]
    assert (
        0
        < real.peak().bytes - fake.peak().bytes
        <= sum(e.nbytes for e in real.entries if e.role == KERNEL_INTERNAL and "backward" in e.name)
    )


def test_fake_trace_restores_the_real_model():
    w = examples.gpt_tiny()
    before = {n: p.clone() for n, p in w.model.state_dict().items()}
    trace(w, fake=True)
    after = w.model.state_dict()
    assert all(type(t) is torch.Tensor and torch.equal(t, before[n]) for n, t in after.items())
    assert w.model.lm_head.weight is w.model.wte.weight  # tying survives the swap


def test_data_dependent_shapes_are_a_clear_error_in_fake_mode():
    with pytest.raises(InputError, match=r"data-dependent shapes.*without --fake"):
        trace(examples.moe(), fake=True)


class _Exits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and getattr(self, "warmed", False):
            sys.exit(3)
        self.warmed = True
        return self.lin(x)


@pytest.mark.parametrize("fake", [False, True])
def test_a_model_that_calls_sys_exit_is_a_clear_error_not_a_silent_exit(fake):
    w = Workload(
        _Exits(), torch.randn(2, 4), loss_fn=lambda out, b: out.sum(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)
    )
    with pytest.raises(InputError, match=r"the traced step called sys.exit\(3\)"):
        trace(w, fake=fake)
    assert not _get_current_dispatch_mode_stack()  # the tracer let go of dispatch


def test_saved_activations_are_told_apart_from_temporaries():
    # y = relu(x @ w1) @ w2: the relu output is saved by the second matmul; mm's output is consumed by relu
    # and not saved (relu saves its *output*).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 4, bias=False))
    w = Workload(model, torch.randn(5, 8), loss_fn=lambda out, b: out.sum(), optimizer=lambda ps: torch.optim.SGD(ps))
    led = trace(w)
    acts = led.select(category=Category.ACTIVATIONS)
    assert [(e.shape, e.owner) for e in acts] == [((5, 16), "1")]  # the relu output, saved once, used by both
    assert all(e.last_use_event is not None and e.last_use_event < e.free_event for e in acts)
    assert all(led.events[e.last_use_event].phase == "backward" for e in acts)
    mm_out = [e for e in led.entries if e.name.startswith("aten.mm#")]
    assert mm_out and mm_out[0].category == Category.WORKSPACE


class _HandsOff(nn.Module):
    """Gives a temporary to another thread, which drops the last reference to it (as gloo's workers do),
    while the traced thread waits for it, pausing (``settling``) or not."""

    def __init__(self, settling: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.settling = settling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        held = [x * 2]  # a 5x4 float temporary, referenced only by the list

        def let_go() -> None:
            held.clear()

        tracer = active_tracer()  # none in the warm-up step
        with tracer.letting_go() if self.settling and tracer is not None else contextlib.nullcontext():
            worker = threading.Thread(target=let_go)
            worker.start()
            worker.join()  # the temporary is freed on the worker, before forward goes on
        return self.fc(x).sum()


def test_frees_on_another_thread_are_counted_and_noted():
    led = trace(Workload(_HandsOff(), torch.randn(5, 4), optimizer=lambda ps: torch.optim.SGD(ps)))
    assert led.meta["frees_on_other_threads"] == 1 and "frees_while_settling" not in led.meta
    assert any("freed by another thread" in n and "aten.mul.Tensor" in n for n in led.notes)
    assert "frees_on_other_threads" not in trace(examples.mlp()).meta


def test_frees_on_another_thread_while_the_step_pauses_for_it_land_where_it_paused():
    led = trace(Workload(_HandsOff(settling=True), torch.randn(5, 4), optimizer=lambda ps: torch.optim.SGD(ps)))
    assert "frees_on_other_threads" not in led.meta and led.meta["frees_while_settling"] == 1
    assert not any("freed by another thread" in n for n in led.notes)
    held = next(e for e in led.entries if e.name.startswith("aten.mul.Tensor#"))
    assert held.free_event == held.alloc_event + 1  # freed before the next op, the linear's first


def test_what_the_caller_of_backward_holds_through_it_is_named():
    """The loss and the gradient seed outlive backward's final callbacks (the saved activations do not): the
    tracer names them, as the sharded prediction needs to place FSDP's final reduce-scatter before them."""
    led = trace(examples.mlp())
    marked = {(name, event) for name, event in led.meta["freed_after_backward"]}
    held = {e.name: e for e in led.entries if (e.name, e.free_event) in marked}
    first_backward = next(ev.index for ev in led.events if ev.phase == "backward")
    first_optimizer = next(ev.index for ev in led.events if ev.phase == "optimizer")
    loss = [e for e in held.values() if e.alloc_event < first_backward]
    seed = [e for e in held.values() if e.alloc_event == first_backward]
    assert len(held) == 2 and len(loss) == 1 and len(seed) == 1
    assert all(e.nbytes == 4 and e.shape == () and e.free_event == first_optimizer for e in held.values())
    saved = led.select(category=Category.ACTIVATIONS)  # freed as their nodes ran, at the same events or before
    assert saved and not any((e.name, e.free_event) in marked for e in saved)


def test_optimizer_ops_name_the_parameter_they_update():
    """A single-tensor Adam updates one parameter after another: each op names its parameter, and each
    temporary (``sqrt``, the division) names the parameter it was made for."""
    w = examples.mlp()
    w.optimizer = lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=False)
    led = trace(w)
    names = [n for n, _ in w.model.named_parameters()]
    runs = [ev.module for ev in led.events if ev.phase == "optimizer"]
    assert [m for i, m in enumerate(runs) if i == 0 or runs[i - 1] != m] == names  # one run per parameter
    temps = [e for e in led.entries if e.alloc_event is not None and led.events[e.alloc_event].phase == "optimizer"]
    assert sorted({e.owner for e in temps}) == sorted(names)
    assert all(led.events[e.alloc_event].module == e.owner for e in temps)
    # a foreach op works on every parameter at once: it names none, each of its outputs names its own
    w = examples.mlp()
    w.optimizer = lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True)
    led = trace(w)
    foreach = [e for e in led.entries if e.name.startswith("aten._foreach_sqrt")]
    assert sorted(e.owner for e in foreach) == sorted(names) and led.events[foreach[0].alloc_event].module == ""


def test_every_event_has_a_phase_and_backward_events_name_their_module():
    led = traced_example("gpt-tiny")
    phases = {e.phase for e in led.events}
    assert phases <= {"forward", "backward", "optimizer", "zero_grad"} and "backward" in phases
    bwd_modules = {e.module for e in led.events if e.phase == "backward"}
    assert "blocks.0.attn" in bwd_modules and "blocks.3.mlp.fc" in bwd_modules


def test_a_backward_op_names_the_module_call_whose_forward_made_its_node():
    # The model's own ops between its submodules (tanh, sigmoid), a submodule's (b's GELU), the loss's (in the
    # loss function, outside the model), and a reentrant checkpoint's recomputation in backward: c's nodes,
    # made again by c, and the SiLU its function applies outside any module (no call of the forward made it).
    from torch.nn import functional as F
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.c = nn.Linear(8, 8), nn.Linear(8, 8)
            self.b = nn.Sequential(nn.Linear(8, 8), nn.GELU())

        def forward(self, x):
            h = torch.sigmoid(self.b(torch.tanh(self.a(x))))
            return checkpoint(lambda t: F.silu(self.c(t)), h, use_reentrant=True)

    torch.manual_seed(0)
    led = trace(Workload(Net(), torch.randn(4, 8), loss_fn=lambda o, _b: F.logsigmoid(o).mean()))
    backward = [e for e in led.events if e.phase == "backward"]
    by_op = {e.op: {x.module for x in backward if x.op == e.op} for e in backward}
    assert by_op["aten.tanh_backward"] == {"(root)"}  # behind b's nodes: the root's walk never reached it
    assert by_op["aten.sigmoid_backward"] == {"(root)"}
    assert by_op["aten.gelu_backward"] == {"b.1"}
    assert by_op["aten.log_sigmoid_backward"] == {LOSS_SCOPE}
    assert by_op["aten.silu_backward"] == {""}
    assert {"a", "b.0", "c"} <= by_op["aten.mm"]


def test_a_module_called_on_another_thread_names_its_backward_ops():
    # autograd numbers nodes per thread: a call on another thread labels its nodes instead (its forward ops run
    # out of the tracer's sight, whose dispatch mode is the tracing thread's; their backward runs here)
    from torch.nn import functional as F

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Sequential(nn.Linear(8, 8), nn.GELU())

        def forward(self, x):
            out = {}
            worker = threading.Thread(target=lambda: out.update(h=self.b(x)))
            worker.start()
            worker.join()
            return F.silu(self.a(out["h"]))

    torch.manual_seed(0)
    led = trace(Workload(Net(), torch.randn(4, 8), loss_fn=lambda o, _b: o.mean()))
    backward = [e for e in led.events if e.phase == "backward"]
    assert {e.module for e in backward if e.op == "aten.gelu_backward"} == {"b.1"}
    assert {e.module for e in backward if e.op == "aten.silu_backward"} == {"(root)"}


def test_a_module_cast_inside_forward_on_fake_tensors_is_refused_with_what_to_do():
    # SwitchTransformers' router calls ``self.classifier.to(self.dtype)`` in forward: PyTorch swaps a fake
    # parameter's tensors for that, which a weak reference to the parameter forbids (fake tensors' own may be
    # gone by then, depending on what ran before: this model keeps one, so the swap always fails)
    import weakref

    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.classifier = nn.Linear(8, 4)

        def forward(self, x):
            self.seen = weakref.ref(self.classifier.weight)
            self.classifier = self.classifier.to(torch.float32)
            return self.classifier(x)

    w = Workload(Router(), torch.randn(2, 8), loss_fn=lambda o, _b: o.sum())
    with pytest.raises(InputError, match=r"Module\.to\(\).*trace it without --fake"):
        trace(w, fake=True)
    assert trace(w).peak().bytes > 0  # the real step runs


def test_frozen_reference_under_no_grad_works():
    led = traced_example("dpo")
    frozen = sum(e.nbytes for e in led.select(category=Category.FROZEN))
    w = examples.dpo()
    assert frozen == sum(p.numel() * p.element_size() for p in w.reference.parameters())
    assert led.peak().by_category["frozen"] == frozen


def test_gradients_and_optimizer_state_are_named():
    led = trace(examples.mlp())
    grads = led.select(category=Category.GRADIENTS)
    w = examples.mlp()
    assert sorted(e.name for e in grads) == sorted(f"{n}.grad" for n, _ in w.model.named_parameters())
    assert sum(e.nbytes for e in grads) == sum(p.numel() * 4 for p in w.model.parameters())
    assert all(led.events[e.free_event - 1].phase == "optimizer" for e in grads)  # freed by zero_grad
    assert {e.role for e in led.select(category=Category.OPTIMIZER)} == {"momentum_buffer"}


class _FreshStateSGD(torch.optim.SGD):
    """SGD that replaces a state tensor with a new one every step (a steady-state step creates state)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["average"] = p.detach().clone()
        return loss


def test_state_an_optimizer_creates_in_the_step_is_named():
    # A steady-state step usually creates no optimizer state, and the tracer then skips naming it; state
    # made anew in the traced step must still be named, with the bytes and the parameter it is for.
    w = examples.mlp()
    w.optimizer = lambda params: _FreshStateSGD(params, lr=0.1)
    led = trace(w)
    made = [e for e in led.select(category=Category.OPTIMIZER) if e.role == "average" and e.alloc_event is not None]
    params = dict(w.model.named_parameters())
    assert sorted(e.name for e in made) == sorted(f"optimizer.{n}.average" for n in params)
    assert all(led.events[e.alloc_event].phase == "optimizer" for e in made)
    assert {e.name: e.nbytes for e in made} == {f"optimizer.{n}.average": p.numel() * 4 for n, p in params.items()}
    assert not [
        e
        for e in led.entries
        if e.category == Category.WORKSPACE and e.role == "optimizer_temporary" and e.free_event is None
    ]


def test_gradient_accumulation_is_modelled_in_place():
    # x feeds two matmuls: the engine adds the two input-gradients in place when untraced.
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            h = torch.tanh(x)
            return (self.a(h) + self.b(h)).sum()

    x = torch.randn(64, 32, requires_grad=False)
    led = trace(Workload(Two(), x, optimizer=lambda ps: torch.optim.SGD(ps)))
    adds = [e for e in led.entries if e.name.startswith("aten.add.Tensor#") and e.category == Category.WORKSPACE]
    bwd_adds = [e for e in adds if led.events[e.alloc_event].phase == "backward"]
    assert bwd_adds == []  # folded into the first gradient, as InputBuffer::accumulate does


class _Chunked(nn.Module):
    """Two layers run on each of four chunks of the batch: each weight's gradient arrives four times."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 48)

    def forward(self, x):
        return sum(self.b(torch.relu(self.a(c))).square().mean() for c in x.chunk(4))


def test_a_gradient_that_is_a_view_is_accumulated_out_of_place_as_the_profiler_counts():
    # A weight's gradient from one use is a view (the transpose of a matrix product's output); the engine adds
    # in place only into a tensor that holds its storage alone, so the four uses' gradients are added out of
    # place: the adds allocate, untraced too.
    from torch.profiler import ProfilerActivity, profile

    from tests.oracle_profiler import two_steps, window_peak
    from trainledger.workload import run_step

    def chunked() -> Workload:
        torch.manual_seed(0)
        return Workload(_Chunked(), torch.randn(64, 32), loss_fn=lambda o, _b: o, optimizer=torch.optim.SGD)

    led = trace(chunked())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        two_steps(chunked(), run_step)
    assert led.peak().bytes == window_peak(prof)
    # the first add of two of a weight's gradients makes the buffer the rest are added into, the gradient
    grads = {e.name: led.events[e.alloc_event] for e in led.select(category=Category.GRADIENTS)}
    assert {(e.phase, e.op) for e in grads.values()} == {("backward", "aten.add.Tensor")}


class _AveragedAttention(nn.Module):
    """Attention probabilities used twice: by the output's matrix product and, through a ``view``, by their
    average over heads (what ``nn.MultiheadAttention(need_weights=True)`` returns)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(32, 32)

    def forward(self, x):
        b, n, c = x.shape
        q = self.q(x).view(b, n, 4, c // 4).transpose(1, 2).reshape(b * 4, n, c // 4)
        k = x.view(b, n, 4, c // 4).transpose(1, 2).reshape(b * 4, n, c // 4)
        probs = torch.bmm(q, k.transpose(1, 2)).softmax(-1)
        out = torch.bmm(probs, k)
        averaged = probs.view(b, 4, n, n).mean(dim=1)  # made last, so its gradient comes first in backward
        return out.square().mean() + 0.0 * averaged.mean()


def test_a_sum_of_gradients_whose_first_is_a_view_is_a_new_tensor_as_the_profiler_counts():
    # The engine adds the later gradient into the first one only: the probabilities' gradient through the view
    # arrives first and is a view, so the sum is allocated, untraced too; folding it into the dense second
    # gradient (the matrix product's) left the sum out of the ledger (the probabilities' size, 4,194,304 bytes,
    # a quarter of the peak). Made in the other order, the view's gradient comes second and the sum is in place.
    from torch.profiler import ProfilerActivity, profile

    from tests.oracle_profiler import two_steps, window_peak
    from trainledger.workload import run_step

    def averaged() -> Workload:
        torch.manual_seed(0)
        return Workload(_AveragedAttention(), torch.randn(4, 256, 32), optimizer=torch.optim.SGD)

    led = trace(averaged())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        two_steps(averaged(), run_step)
    assert led.peak().bytes == window_peak(prof)


class _Residual(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, hidden), nn.Linear(hidden, 32)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _residual_chain() -> Workload:
    # block 1 is the widest, so the step peaks in its backward, after the residual stream's gradient has been
    # accumulated into twice (once per later block)
    torch.manual_seed(0)
    model = nn.Sequential(*(_Residual(h) for h in (16, 512, 16, 16)))
    return Workload(model, torch.randn(128, 32), loss_fn=lambda o, b: o.square().mean(), optimizer=torch.optim.SGD)


@pytest.mark.slow
def test_chained_gradient_accumulations_are_one_buffer_as_the_profiler_counts():
    # The residual stream's gradient is added to once per block, in place, into one buffer. Folding each traced
    # add into the buffer the previous one was folded into keeps that buffer live to the end; folding into the
    # previous add's own record (merged away) dropped one gradient (16,384 bytes here) from the second block on.
    from torch.profiler import ProfilerActivity, profile

    from tests.oracle_profiler import two_steps, window_peak
    from trainledger.workload import run_step

    traced = trace(_residual_chain()).peak()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        two_steps(_residual_chain(), run_step)
    assert traced.phase == "backward"
    assert traced.bytes == window_peak(prof)


def test_an_add_recomputed_by_a_checkpoint_is_not_folded_as_an_accumulation():
    # The engine accumulates gradients with grad mode off; a checkpoint recomputes its forward with it on, and
    # the recomputed residual add makes a new tensor while its operand is still live, as in forward.
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            return checkpoint(lambda t: self.b(t + self.a(t)), x, use_reentrant=False)

    led = trace(Workload(Block(), torch.randn(64, 32), loss_fn=lambda o, b: o.square().mean()))
    adds = [e.index for e in led.events if e.phase == "backward" and e.op == "aten.add.Tensor" and e.module == "b"]
    assert adds  # the recomputation's add runs in backward, attributed to the node that unpacked b's input
    made = [e for e in led.entries if e.alloc_event in adds]
    assert [(e.nbytes, e.free_event - e.alloc_event > 1) for e in made] == [(64 * 32 * 4, True)]


class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        raise RuntimeError("kaboom")


@pytest.mark.parametrize(
    ("workload", "fragment"),
    [
        (lambda: Workload(Boom(), torch.randn(3, 2)), "raised RuntimeError: kaboom"),
        (lambda: Workload(nn.Linear(2, 3), torch.randn(4, 2)), "not a scalar"),
        (
            lambda: Workload(nn.Linear(2, 1), torch.randn(4, 2), loss_fn=lambda o, b: o.detach().sum()),
            "does not require grad",
        ),
        (lambda: Workload(nn.Linear(2, 1).requires_grad_(False), torch.randn(4, 2)), "no trainable parameters"),
    ],
)
def test_bad_steps_fail_clearly_and_leave_nothing_behind(workload, fragment):
    import torch.nn.modules.module as mm

    before = (len(mm._global_forward_pre_hooks), len(mm._global_forward_hooks))
    with pytest.raises(InputError, match=fragment):
        trace(workload())
    assert (len(mm._global_forward_pre_hooks), len(mm._global_forward_hooks)) == before
    assert _get_current_dispatch_mode_stack() == []
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    # and the process can still trace normally afterwards
    assert trace(examples.mlp()).peak().bytes > 0


def test_cli_trace_json_and_outputs(cli, tmp_path):
    png, snap, perf = tmp_path / "s.png", tmp_path / "s.pickle", tmp_path / "p.json"
    code, out, err = cli(
        "trace",
        "--model",
        "mlp",
        "--json",
        "--plot",
        str(png),
        "--export-memory-viz",
        str(snap),
        "--export-perfetto",
        str(perf),
    )
    assert code == 0, err
    d = json.loads(out)
    assert d["evidence"] == "traced" and d["peak"]["bytes"] == trace(examples.mlp()).peak().bytes
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and snap.stat().st_size > 0
    assert json.loads(perf.read_text())["traceEvents"]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["trace"], "give --model"),
        (["trace", "--model", "mlp", "--plot", "x.gif"], "accepted: .png, .svg"),
        (["trace", "--model", "mlp", "--fake", "--measure"], "drop one of them"),
        (["trace", "--model", "moe", "--fake"], "data-dependent"),
    ],
)
def test_cli_trace_bad_input(cli, argv, fragment):
    code, _, err = cli(*argv)
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_measurement_uses_the_caching_allocators_counters():
    from trainledger.measure import measure

    w = examples.mlp()
    w.model.cuda()
    w.batch = tuple(t.cuda() for t in w.batch)
    m = measure(w, num_steps=3)
    assert m.device.startswith("cuda") and m.start_source == "allocator"
    assert m.reserved_peak_bytes is not None and m.reserved_peak_bytes >= m.peak_bytes
    # CUDA rounds every block up to 512 bytes: measured is at least traced, and not by more than that per block
    traced = m.traced
    assert traced.peak().bytes <= m.peak_bytes <= traced.peak().bytes + 512 * len(traced.live_at(traced.peak().event))
    assert len(m.step_seconds) == 3 and m.median_step_seconds > 0


class _GroupedMatmul(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(x, self.w)


def test_a_fake_kernel_that_refuses_real_inputs_is_one_line_naming_it(capfd):
    """PyTorch's meta kernel of ``_grouped_mm`` takes bf16 only, its CPU kernel fp32 too: the fake trace is
    refused in one line naming the op, and PyTorch's log of the failure (a traceback) is not printed."""
    w = Workload(_GroupedMatmul(), torch.randn(4, 8, 16), loss_fn=lambda out, batch: out.square().mean())
    assert trace(w).peak().bytes > 0  # the real kernel runs it
    capfd.readouterr()
    with pytest.raises(InputError, match=r"fake-tensor kernel of aten\._grouped_mm\.default refused") as info:
        trace(w, fake=True)
    assert "\n" not in str(info.value)
    assert capfd.readouterr().err == ""


class _UnusedHead(nn.Module):
    """A head whose output the loss never uses, dropped at once; tanh saves its own output for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.aux, self.out = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        unused = torch.tanh(self.aux(h))
        del unused
        return self.out(h).pow(2).mean()


def _live_tensors() -> int:
    import gc

    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def test_a_graph_dropped_without_backward_is_freed_where_the_step_drops_it():
    """A saved-tensor hook that keeps the tensor it is given keeps its ``grad_fn``; an output its own node saves
    then holds that node, a cycle of C++ objects no collector frees. Backward breaks it, but a graph dropped without
    one (here an unused head) lived on: 4,352 bytes over the allocator's count of the same step, and its tensors
    left in the process after the trace. The hook keeps the tensor without its history, as autograd does."""
    from trainledger.measure import measure

    def build() -> Workload:
        torch.manual_seed(0)
        return Workload(_UnusedHead(), torch.randn(16, 16), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))

    workload = build()
    before = _live_tensors()
    led = trace(workload)
    assert _live_tensors() == before
    aux = [e for e in led.entries if e.owner == "aux" and e.category == Category.ACTIVATIONS]
    assert not aux  # made in forward, freed there: never saved past the head's drop
    head = [e for e in led.entries if e.owner == "aux" and e.alloc_event is not None]
    assert head and all(led.events[e.free_event].phase == "forward" for e in head), head
    assert measure(build(), num_steps=1).peak_bytes == led.peak().bytes
    assert trace(build(), fake=True).peak().bytes == led.peak().bytes


class _Attention(nn.Module):
    def __init__(self, width: int = 64, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c)).square().mean()


def test_sdpa_s_cpu_flash_kernel_holds_its_buffers_inside_the_op():
    """The CPU flash kernel keeps per-thread blocks of scores in forward and per-thread gradient accumulators in
    backward, freed before it returns: probed like a convolution. A diffusion transformer (Flux) peaked inside its
    backward, 13% above the tensor trace."""
    from trainledger.measure import measure

    def build() -> Workload:
        torch.manual_seed(0)
        return Workload(_Attention(), torch.randn(2, 256, 64), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))

    m = measure(build(), num_steps=1)
    internal = m.traced.select(role=KERNEL_INTERNAL)
    ops = {m.traced.events[e.alloc_event].op for e in internal}
    assert "aten._scaled_dot_product_flash_attention_for_cpu_backward" in ops, ops
    assert 0 <= m.peak_bytes - m.traced.peak().bytes <= 16, (m.peak_bytes, m.traced.peak().bytes)
    assert trace(build(), fake=True).peak().bytes == m.traced.peak().bytes


class _Prompted(nn.Module):
    """A model whose optimizer also trains a tensor kept beside it (a soft prompt), not one of its parameters."""

    def __init__(self, prompt: nn.Parameter) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.prompt = [prompt]  # a list: not registered as the module's parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) + self.prompt[0]).square().mean()


def test_a_tensor_the_optimizer_trains_beside_the_model_is_weights_with_its_gradient():
    torch.manual_seed(0)
    prompt = nn.Parameter(torch.zeros(4))
    model = _Prompted(prompt)
    w = Workload(model, torch.randn(8, 16), optimizer=lambda ps: torch.optim.Adam([*ps, prompt], lr=1e-3))
    led = trace(w)
    weights = sum(p.numel() * p.element_size() for p in [*model.parameters(), prompt])
    assert sum(e.nbytes for e in led.select(category=Category.WEIGHTS)) == weights
    beside = {e.name: e.category for e in led.entries if e.name.startswith("optimizer.group0.param2")}
    assert beside["optimizer.group0.param2"] == Category.WEIGHTS  # it was 'captured', other
    assert beside["optimizer.group0.param2.grad"] == Category.GRADIENTS  # it was a backward temporary
