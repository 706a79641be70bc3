"""``Plan.export_policy``: the exported file, imported where trainledger cannot be found, runs the plan.

Oracles: the step's peak under the exported file's ``apply`` against the plan's own traced peak (the tracer
in this process; the profiler's allocation events in a fresh one, which equal the traced peak for gpt-tiny,
see test_trace.py), and the gradients against ``Plan.apply``'s, bitwise.
"""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.zoo import ZOO
from trainledger import examples, remat
from trainledger.trace import trace
from trainledger.workload import Workload, call_model, compute_loss

ROOT = Path(__file__).resolve().parents[1]

# The fresh process: `python -I -S` (no PYTHONPATH, no site hooks: the editable install of trainledger is
# not on the path), sys.path = the policy file's folder and torch's folder only. It imports the policy
# before trainledger can be found, then adds the project to build the same seeded model and run the step.
CHILD = r"""
import importlib.util, json, sys
folder, torch_dir, root, name, out, plan_file = sys.argv[1:]
sys.path[:] = [folder, torch_dir] + [p for p in sys.path if "site-packages" not in p]
assert importlib.util.find_spec("trainledger") is None, "trainledger is importable"
import remat_policy
assert not [m for m in sys.modules if m.startswith("trainledger")]
import torch
from torch.profiler import ProfilerActivity, profile
sys.path += [root, root + "/src"]
from tests.oracle_profiler import two_steps, window_peak
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    from trainledger import examples
    from trainledger.workload import call_model, compute_loss, run_step
    from trainledger.remat import Plan
    from tests.zoo import ZOO
    runner = Plan.load(plan_file) if plan_file else remat_policy  # Plan.apply: the same count for the plan
    w = ZOO[name]() if name in ZOO else examples.build(name)
    runner.apply(w.model)
    two_steps(w, run_step)
w = ZOO[name]() if name in ZOO else examples.build(name)  # fresh weights: gradients from the seeded state
runner.apply(w.model)
torch.manual_seed(0)
compute_loss(w, call_model(w.model, w.batch)).backward()
torch.save({n: p.grad for n, p in w.model.named_parameters() if p.grad is not None}, out + ".pt")
json.dump({"peak_bytes": window_peak(prof)}, open(out + ".json", "w"))
"""


def build(name: str) -> Workload:
    return ZOO[name]() if name in ZOO else examples.build(name)


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("remat_policy_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gradients(w: Workload, runner: object) -> dict[str, torch.Tensor]:
    runner.apply(w.model)  # type: ignore[attr-defined]
    try:
        torch.manual_seed(0)
        compute_loss(w, call_model(w.model, w.batch)).backward()
    finally:
        runner.remove(w.model)  # type: ignore[attr-defined]
    out = {n: p.grad.clone() for n, p in w.model.named_parameters() if p.grad is not None}
    w.model.zero_grad(set_to_none=True)
    return out


def traced_peak(w: Workload, runner: object) -> int:
    runner.apply(w.model)  # type: ignore[attr-defined]
    try:
        return trace(w).peak().bytes
    finally:
        runner.remove(w.model)  # type: ignore[attr-defined]


def run_child(path: Path, name: str, plan_file: Path | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    """The profiler's peak and the gradients in a fresh process, under the exported file (or ``plan_file``)."""
    torch_dir = str(Path(torch.__file__).resolve().parents[1])
    out = path.parent / ("child" if plan_file is None else "child_plan")
    args = [str(path.parent), torch_dir, str(ROOT), name, str(out), str(plan_file or "")]
    subprocess.run([sys.executable, "-I", "-S", "-c", CHILD, *args], check=True, timeout=300)
    peak = json.loads(Path(str(out) + ".json").read_text())["peak_bytes"]
    return peak, torch.load(str(out) + ".pt")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "budget"), [("gpt-tiny", "60%"), ("shared-block", "70%")])
def test_exported_policy_reproduces_the_plans_peak_and_gradients(tmp_path, name, budget):
    w = build(name)
    plan = remat.plan(w, budget, cost="flops")
    assert plan.regions
    if name == "shared-block":
        assert any(r.call is not None for r in plan.regions)  # per-call regions of one module
    path = tmp_path / "remat_policy.py"
    plan.export_policy(path, command=f"trainledger plan --model {name} --budget {budget}")
    text = path.read_text()
    assert text.startswith("# Activation checkpointing plan exported by trainledger")
    assert "import trainledger" not in text and "from trainledger" not in text
    exported = load(path)
    assert [r[0] for r in exported.REGIONS] == [r.path for r in plan.regions]

    plan_peak = traced_peak(w, plan)
    assert plan_peak <= plan.budget_bytes
    assert traced_peak(w, exported) == plan_peak
    want = gradients(w, plan)
    got = gradients(w, exported)
    assert want.keys() == got.keys() and want
    assert all(torch.equal(want[n], got[n]) for n in want)

    child_peak, child_grads = run_child(path, name)
    if name == "gpt-tiny":
        plan.save(tmp_path / "plan.json")
        profiled_plan_peak, _ = run_child(path, name, tmp_path / "plan.json")
        assert child_peak == profiled_plan_peak
        # The profiler counts 32 bytes more than the tracer here (6,694,392 and 6,694,360): small buffers made
        # outside dispatch. The CPU RNG states the checkpointed calls keep (5,056 bytes each) are traced.
        assert 0 <= child_peak - plan_peak <= 64
    assert child_grads.keys() == want.keys()
    assert all(torch.equal(want[n], child_grads[n]) for n in want)


@pytest.mark.slow
def test_exported_policy_restores_buffers_as_the_plan_does(tmp_path):
    w = build("stateful-cnn")
    plan = remat.plan(w, "70%", cost="flops")
    assert any(r.restore for r in plan.regions)
    path = tmp_path / "remat_policy.py"
    plan.export_policy(path)
    exported = load(path)
    assert traced_peak(w, exported) == traced_peak(w, plan)
    assert remat.compare_state(w, exported)[0]  # a whole step, buffers and optimizer state included


def test_a_model_under_a_plan_refuses_to_be_copied_and_copies_after_remove(tmp_path):
    """The wrapped forwards call the original's modules: a deep copy (an EMA, a teacher) trained the original's
    blocks and none of its own, without a word."""
    import copy

    from trainledger.errors import InputError

    w = build("gpt-tiny")
    plan = remat.plan(w, "70%", cost="flops")
    path = tmp_path / "remat_policy.py"
    plan.export_policy(path)
    exported = load(path)
    for runner, error in ((plan, InputError), (exported, RuntimeError)):
        runner.apply(w.model)
        with pytest.raises(error, match="cannot be copied or pickled whole"):
            copy.deepcopy(w.model)
        with pytest.raises(error, match="cannot be copied or pickled whole"):
            torch.save(w.model, io.BytesIO())  # not pickle's "Can't pickle local object"
        if runner is plan:  # another plan's remove would leave this one's regions wrapped
            other = remat.Plan(regions=(remat.Region("ln_f"),), fingerprint=plan.fingerprint)
            with pytest.raises(InputError, match="runs under another plan"):
                other.remove(w.model)
        runner.remove(w.model)
        clone = copy.deepcopy(w.model)  # without the plan: a model of its own, whose backward is its own
        twin = Workload(clone, w.batch, loss_fn=w.loss_fn)
        compute_loss(twin, call_model(clone, w.batch)).backward()
        assert all(p.grad is None for p in w.model.parameters()) and all(p.grad is not None for p in clone.parameters())


@pytest.mark.parametrize("name", ["remat-policy.py", "policy.txt", "missing/policy.py", "class.py", "policy.PY"])
def test_cli_refuses_a_policy_path_before_any_work(tmp_path, capsys, name):
    from trainledger.cli import main

    args = ["plan", "--model", "gpt-tiny", "--budget", "60%", "--export-policy", str(tmp_path / name)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "policy file" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("flag", ["--export-policy", "--save"])
def test_cli_refuses_an_empty_output_path(capsys, flag):
    from trainledger.cli import main

    assert main(["plan", "--model", "gpt-tiny", "--budget", "60%", flag, ""]) == 2  # it wrote nothing, silently
    assert f"{flag} was given an empty path" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_writes_the_policy_with_the_command_that_made_it(tmp_path, capsys):
    from trainledger.cli import main

    path = tmp_path / "remat_policy.py"
    assert (
        main(["plan", "--model", "gpt-tiny", "--budget", "60%", "--cost", "flops", "--export-policy", str(path)]) == 0
    )
    assert f"wrote {path}" in capsys.readouterr().out.replace("\n", "")
    text = path.read_text()
    assert "# made by: trainledger plan --model gpt-tiny --budget 60% --cost flops\n" in text
    assert load(path).REGIONS


@pytest.mark.slow
def test_a_hugging_face_model_with_its_cache_on_recomputes_with_it_off_and_gets_it_back(tmp_path):
    """transformers builds models with ``use_cache=True``: a recomputed layer appended to the key/value cache
    again and saved other tensors (``CheckpointError`` in backward). ``apply`` turns it off, as transformers'
    own gradient checkpointing does, and ``remove`` turns it on again; the gradients are the plain step's."""
    from trainledger.analytic import Setup
    from trainledger.hf import workload_from_setup

    w = workload_from_setup(
        Path(__file__).parent / "fixtures" / "hf" / "llama-small.json", Setup(micro_batch=2, seq_len=256)
    )
    plan = remat.plan(w, "85%", cost="flops")
    assert plan.regions
    torch.manual_seed(0)
    compute_loss(w, call_model(w.model, w.batch)).backward()
    plain = {n: p.grad.clone() for n, p in w.model.named_parameters() if p.grad is not None}
    path = tmp_path / "remat_policy.py"
    plan.export_policy(path)
    for runner in (plan, load(path)):
        w.model.config.use_cache = True
        with pytest.warns(UserWarning, match="use_cache=True does not go with recomputation"):
            runner.apply(w.model)
        assert w.model.config.use_cache is False
        w.model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        compute_loss(w, call_model(w.model, w.batch)).backward()
        got = {n: p.grad for n, p in w.model.named_parameters() if p.grad is not None}
        runner.remove(w.model)
        assert w.model.config.use_cache is True
        assert got.keys() == plain.keys() and all(torch.equal(got[n], plain[n]) for n in plain)


@pytest.mark.slow
def test_an_encoder_decoders_own_decoder_config_has_its_cache_off_while_it_recomputes(tmp_path):
    """T5's decoder keeps a copy of the config and reads ``use_cache`` from it when the caller passes none: with
    only ``model.config`` turned off, a recomputed cross-attention found its keys and values cached, skipped
    their projections and saved fewer tensors (``CheckpointError`` in backward). Every config is turned off,
    and back on after."""
    import transformers

    from trainledger.remat import Region

    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0
    )
    model = transformers.T5ForConditionalGeneration(config).train()
    ids, labels = torch.randint(1, 64, (2, 12)), torch.randint(1, 64, (2, 8))
    w = Workload(model, {"input_ids": ids, "labels": labels})
    # the plain step the plan is held to is the one without a cache, as the planner traces it: with the cache on,
    # the decoder builds its keys and values through the cache, and on some processors its products then round
    # differently (by 1e-8 here)
    model.config.use_cache = model.decoder.config.use_cache = False
    torch.manual_seed(0)
    compute_loss(w, call_model(model, w.batch)).backward()
    model.config.use_cache = model.decoder.config.use_cache = True
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    plan = remat.Plan(
        regions=(Region("decoder.block.0.layer.1"), Region("decoder.block.1")),
        fingerprint=remat.structure_fingerprint(model),
    )
    path = tmp_path / "remat_policy.py"
    plan.export_policy(path)
    for runner in (plan, load(path)):
        with pytest.warns(UserWarning, match="use_cache=True does not go with recomputation"):
            runner.apply(model)
        assert model.config.use_cache is False and model.decoder.config.use_cache is False
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        compute_loss(w, call_model(model, w.batch)).backward()
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        runner.remove(model)
        assert model.config.use_cache is True and model.decoder.config.use_cache is True
        assert got.keys() == plain.keys() and all(torch.equal(got[n], plain[n]) for n in plain)


def test_a_plan_and_its_exported_policy_do_not_stack_and_a_failed_apply_wraps_nothing(tmp_path):
    from torch import nn

    from trainledger.errors import InputError

    w = build("gpt-tiny")
    plan = remat.plan(w, "70%", cost="flops")
    path = tmp_path / "remat_policy.py"
    plan.export_policy(path)
    exported = load(path)
    plan.apply(w.model)
    with pytest.raises(RuntimeError, match="already runs under a plan or policy"):
        exported.apply(w.model)  # nested checkpoints, and remove left the other's state behind
    plan.remove(w.model)
    exported.apply(w.model)
    with pytest.raises(InputError, match="already runs under a plan"):
        plan.apply(w.model)
    exported.remove(w.model)
    other = nn.Sequential(nn.Linear(4, 4))  # none of the plan's modules: refused before any is wrapped
    with pytest.raises(AttributeError):
        exported.apply(other)
    assert not any(k.startswith("_remat_policy") for m in other.modules() for k in m.__dict__)
    assert not other._forward_pre_hooks


def test_a_region_given_one_tensor_as_several_arguments_recomputes_under_saved_tensor_hooks(tmp_path):
    """Self-attention's ``attn(h, h, h)``: under saved-tensor hooks (offloading to the host here) each saved
    input comes back as a tensor of its own, and ``nn.MultiheadAttention`` would take another path when
    recomputed (``CheckpointError``). The exported file passes each tensor once, as ``Plan.apply`` does:
    the gradients of both equal the plain step's, bitwise."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(x)

    torch.manual_seed(0)
    model = nn.Sequential(Block(12), Block(12))
    x = torch.randn(3, 7, 12)
    plan = remat.Plan(
        regions=(remat.Region("0.attn"), remat.Region("1")), fingerprint=remat.structure_fingerprint(model)
    )
    path = tmp_path / "remat_policy.py"
    plan.export_policy(path)

    def grads() -> list[torch.Tensor]:
        with torch.autograd.graph.save_on_cpu():
            model(x).square().mean().backward()
        out = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return out

    plain = grads()
    for runner in (load(path), plan):
        runner.apply(model)
        try:
            assert all(torch.equal(a, b) for a, b in zip(grads(), plain, strict=True))
        finally:
            runner.remove(model)


def test_a_regions_keyword_arguments_reach_its_module_not_checkpoint(tmp_path):
    """``torch.utils.checkpoint`` keeps keywords of its own (``debug``, ``early_stop``, ``use_reentrant``): a
    module whose forward takes one lost it (or the call raised) under a plan. Both ``Plan.apply`` and the
    exported file give the module every keyword: outputs and gradients bitwise the plain step's."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(6, 6)

        def forward(
            self, x: torch.Tensor, *, debug: bool = False, early_stop: bool = False, use_reentrant: bool = False
        ) -> torch.Tensor:
            y = torch.tanh(self.linear(x))
            return y * 2 if debug else y * 0.5 if early_stop else y - 1 if use_reentrant else y

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()

        def forward(self, x: torch.Tensor, **flags: bool) -> torch.Tensor:
            return self.block(x, **flags)

    torch.manual_seed(0)
    model, x = Model(), torch.randn(4, 6)
    plan = remat.Plan(regions=(remat.Region("block"),), fingerprint=remat.structure_fingerprint(model))
    path = tmp_path / "remat_policy.py"
    plan.export_policy(path)

    def run(flags: dict[str, bool]) -> list[torch.Tensor]:
        out = model(x, **flags)
        out.square().sum().backward()
        result = [out.detach(), *(p.grad.clone() for p in model.parameters())]
        model.zero_grad(set_to_none=True)
        return result

    for flags in ({"debug": True}, {"early_stop": True}, {"use_reentrant": True}):
        plain = run(flags)
        for runner in (plan, load(path)):
            runner.apply(model)
            try:
                assert all(torch.equal(a, b) for a, b in zip(run(flags), plain, strict=True)), flags
            finally:
                runner.remove(model)


def test_a_hand_written_region_on_a_batchnorm_block_updates_its_statistics_once(tmp_path):
    """A region written by hand lists no buffers to restore: recomputed, its BatchNorm updated the running
    statistics a second time (a plan made by ``plan`` lists what its trace saw written). Both ways of applying
    now recompute on a copy of every running statistic inside the region: buffers and gradients bitwise the plain
    step's. A module that works in place on its input is refused as a region."""
    from torch import nn

    from trainledger.errors import InputError

    def block() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(inplace=True))

    torch.manual_seed(0)
    model = nn.Sequential(block(), block(), nn.BatchNorm2d(3, momentum=None))  # momentum=None: a cumulative mean
    x = torch.randn(2, 3, 6, 6)
    plan = remat.Plan(regions=(remat.Region("0"), remat.Region("2")), fingerprint=remat.structure_fingerprint(model))
    path = tmp_path / "remat_policy.py"
    plan.export_policy(path)
    start = {k: v.clone() for k, v in model.state_dict().items()}

    def step() -> dict[str, torch.Tensor]:
        model.load_state_dict(start)
        model(x).square().mean().backward()
        after = {**model.state_dict(), **{f"{n}.grad": p.grad.clone() for n, p in model.named_parameters()}}
        model.zero_grad(set_to_none=True)
        return {k: v.clone() for k, v in after.items()}

    plain = step()
    for runner in (plan, load(path)):
        runner.apply(model)
        try:
            planned = step()
        finally:
            runner.remove(model)
        assert planned.keys() == plain.keys()
        assert all(torch.equal(planned[k], plain[k]) for k in plain), [
            k for k in plain if not torch.equal(planned[k], plain[k])
        ]
    with pytest.raises(InputError, match=r"'1\.2' works in place on its input"):
        remat.Plan(regions=(remat.Region("1.2"),), fingerprint=remat.structure_fingerprint(model)).apply(model)


@pytest.mark.slow
def test_a_plan_for_a_model_with_its_cache_on_is_predicted_on_the_step_it_runs():
    """A plan turns the key/value cache off, and with it off GPT-NeoX's attention saves its value as a view of the
    fused projection (the cache's copies before): the plain step is traced with the cache off too, or the
    prediction missed the projection's storage (2.6% low, over its budget). The config is left as it was."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128
    )
    model = transformers.GPTNeoXForCausalLM(config).train()
    ids = torch.randint(0, 256, (2, 64))
    w = Workload(model, {"input_ids": ids, "labels": ids})
    plan = remat.plan(w, "75%", cost="flops")
    assert model.config.use_cache is True
    assert any("key/value cache" in n for n in plan.notes)
    with pytest.warns(UserWarning, match="use_cache=True"):
        plan.apply(model)
    traced = trace(w).peak().bytes
    plan.remove(model)
    assert plan.predicted_peak_bytes == traced <= plan.budget_bytes
