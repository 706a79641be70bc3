"""`trainledger plan` and `trainledger pareto` as a user runs them; bad input is one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainledger.remat import Plan

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
SMALL_GPT = """
from trainledger.examples import gpt_tiny
def small():
    return gpt_tiny(n_layer=2, seq_len=32)
"""


@pytest.fixture
def small_gpt(tmp_path) -> str:
    f = tmp_path / "small_gpt.py"
    f.write_text(SMALL_GPT)
    return f"{f}:small"


@pytest.mark.slow
def test_plan_json_has_the_common_keys_and_fits(cli_json, tmp_path, small_gpt):
    saved = tmp_path / "plan.json"
    d = cli_json("plan", "--model", small_gpt, "--budget", "80%", "--save", str(saved))
    for key in ("schema", "evidence", "device", "peak", "category_maxima", "sum_of_category_maxima"):
        assert key in d
    assert d["predicted_peak_bytes"] <= d["budget_bytes"] == d["plain_peak_bytes"] * 80 // 100
    assert d["peak"]["bytes"] == d["predicted_peak_bytes"]
    plan = Plan.load(saved)
    assert [r.path for r in plan.regions] == [r["path"] for r in d["regions"]]


@pytest.mark.slow
@pytest.mark.parametrize("budget", ["100%", "250%", "1e15", "900TiB"])
def test_a_budget_the_plain_step_meets_recomputes_nothing(cli_json, small_gpt, budget):
    d = cli_json("plan", "--model", small_gpt, "--budget", budget)
    assert d["regions"] == [] and d["extra_flops"] == 0
    assert d["budget_bytes"] >= d["plain_peak_bytes"]
    assert any("nothing to recompute" in n for n in d["plan_notes"])


@pytest.mark.slow
def test_plan_verify_as_a_new_user_would(cli):
    code, out, err = cli("plan", "--model", "gpt-tiny", "--budget", "50%", "--verify")
    assert code == 0, err
    assert "recompute" in out and "blocks." in out
    assert "gradients bitwise equal to the plain step's" in out and ": yes (52 of 52)" in out
    assert "(agree, limit 1%)" in out and "within the budget" in out


@pytest.mark.slow
def test_plan_verify_json(cli_json):
    d = cli_json("plan", "--model", "gpt-tiny", "--budget", "60%", "--verify")
    v = d["verification"]
    assert v["gradients_bitwise_equal"] and v["within_budget"] and v["agrees"]
    assert d["peak"]["bytes"] == v["traced_peak_bytes"] and d["evidence"] == "traced"


@pytest.mark.slow
def test_pareto_json(cli_json, tmp_path, small_gpt):
    plot = tmp_path / "curve.png"
    d = cli_json("pareto", "--model", small_gpt, "--budgets", "4", "--plot", str(plot))
    assert d["schema"] == "trainledger.remat-pareto/1" and "peak" in d
    budgets = [r["budget_bytes"] for r in d["rows"]]
    assert budgets[0] == d["plain_peak_bytes"] and budgets[-1] == d["floor_bytes"] and len(budgets) == 4
    for r in d["rows"]:
        assert r["ours"]["peak_bytes"] <= r["budget_bytes"]
        assert r["ours"]["extra_seconds"] == pytest.approx(r["milp"]["extra_seconds"])
    assert plot.stat().st_size > 1000 and d["written"] == [str(plot)]


@pytest.mark.slow
def test_impossible_budget_is_exit_2_with_the_floor(cli, small_gpt):
    code, out, err = cli("plan", "--model", small_gpt, "--budget", "1KiB")
    assert code == 2
    assert "below the floor" in err and "best plan" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_model_without_candidates_says_why(cli):
    code, out, err = cli("plan", "--model", "mlp", "--budget", "50%")
    assert code == 2
    assert "no region worth recomputing" in err and len(err.strip().splitlines()) == 1


CHECKPOINTED = """
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from trainledger import Workload


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 3 * width), nn.SiLU(), nn.Linear(3 * width, width))

    def forward(self, x):
        return x + checkpoint(self.mlp, x, use_reentrant={reentrant})


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(24, 24)  # a reentrant checkpoint needs an input that requires grad
        self.layers = nn.ModuleList(Block(24) for _ in range(5))

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def make():
    torch.manual_seed(0)
    return Workload(Stack(), torch.randn(12, 24))
"""


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_model_that_checkpoints_its_own_blocks_is_told_so_not_to_group_layers(cli, tmp_path, reentrant):
    """Every block recomputes itself already, so no region is left; the message says that (the trace's
    ``recomputed_modules``, in the model's order), not to group layers into blocks, which it has."""
    from trainledger.sources import load_workload
    from trainledger.trace import trace

    (tmp_path / "stack.py").write_text(CHECKPOINTED.format(reentrant=reentrant))
    model = f"{tmp_path / 'stack.py'}:make"
    assert trace(load_workload(model)).meta["recomputed_modules"] == [f"layers.{i}.mlp" for i in range(5)]
    for argv in (("plan", "--model", model, "--budget", "50%"), ("pareto", "--model", model)):
        code, _out, err = cli(*argv)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "already recomputes 5 modules in backward (layers.0.mlp, layers.1.mlp, layers.2.mlp and 2 more" in err
        assert "group layers" not in err
    from trainledger.examples import gpt_tiny

    assert "recomputed_modules" not in trace(gpt_tiny()).meta


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["plan", "--budget", "50%"], "give --model"),
        (["plan", "--model", "gpt-tiny", "--budget", "lots"], "budget 'lots' is not understood"),
        (["plan", "--model", "gpt-tiny", "--budget=-3%"], "budget '-3%'"),
        (
            ["plan", "--model", "gpt-tiny", "--budget", "50%", "--solver", "fast"],
            "argument --solver: invalid choice: 'fast'",
        ),
        (
            ["plan", "--model", "gpt-tiny", "--budget", "50%", "--cost", "joules"],
            "argument --cost: invalid choice: 'joules'",
        ),
        (
            ["plan", "--model", "gpt-tiny", "--budget", "50%", "--save", "plan.txt"],
            "plan path 'plan.txt' has suffix '.txt'; accepted: .json",
        ),
        (["plan", "--model", "nope", "--budget", "50%"], "unknown model 'nope'"),
        (["pareto", "--model", "gpt-tiny", "--budgets", "0"], "--budgets"),
        (
            ["pareto", "--model", "gpt-tiny", "--budgets", "1"],
            "argument --budgets: 1 must be at least 2",  # at once, as 0 is refused
        ),
        (["pareto", "--model", "gpt-tiny", "--plot", "curve.gif"], "accepted: .png, .svg"),
        (
            ["pareto", "--model", "gpt-tiny", "--budget-on", "peak"],
            "argument --budget-on: invalid choice: 'peak'",
        ),
        (["pareto"], "give --model"),
    ],
)
def test_bad_input_is_one_line_exit_2(cli, argv, fragment):
    code, out, err = cli(*argv)
    assert code == 2
    assert fragment in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.slow
def test_plan_file_round_trips_through_json(tmp_path, cli, small_gpt):
    saved = tmp_path / "p.json"
    code, _, err = cli("plan", "--model", small_gpt, "--budget", "90%", "--save", str(saved))
    assert code == 0, err
    data = json.loads(saved.read_text())
    assert data["schema"] == "trainledger.remat-plan/1" and data["fingerprint"]


@pytest.mark.slow
def test_data_dependent_routing_is_verified_from_the_same_weights(cli_json):
    # The MoE's routing depends on the weights; tracing takes optimizer steps, so verification re-traces
    # from the state the plan was made from: same routing, same shapes, the prediction holds.
    d = cli_json("plan", "--model", "moe", "--budget", "95%", "--verify")
    v = d["verification"]
    assert v["within_budget"] and v["gradients_bitwise_equal"] and abs(v["relative_error"]) <= 0.01
    assert [r["path"] for r in d["regions"]] and all(r["path"].startswith("experts.") for r in d["regions"])


def test_solver_and_cost_names_on_the_command_line_match_the_library():
    from trainledger.commands import plan
    from trainledger.remat import BUDGET_ON, COSTS, SOLVERS

    assert plan.SOLVERS == SOLVERS and plan.COSTS == COSTS and plan.BUDGET_ON == BUDGET_ON


def test_missing_scipy_is_one_line_with_the_install_hint(cli, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "scipy" else real(name, *a))
    code, out, err = cli("plan", "--model", "gpt-tiny", "--budget", "50%")
    assert code == 2 and "pip install 'trainledger[solve]'" in err and "scipy" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_trace_under_a_saved_plan_is_the_step_its_verification_traced(cli, cli_json, tmp_path):
    saved = tmp_path / "plan.json"
    planned = cli_json("plan", "--model", "gpt-tiny", "--budget", "60%", "--verify", "--save", str(saved))
    plain = cli_json("trace", "--model", "gpt-tiny")
    under = cli_json("trace", "--model", "gpt-tiny", "--plan", str(saved))
    # the same planned step as --verify traced it, byte for byte, and below the plain step
    assert under["peak"]["bytes"] == planned["verification"]["traced_peak_bytes"] < plain["peak"]["bytes"]
    note = next(n for n in under["notes"] if n.startswith("traced under the plan"))
    assert f"{len(planned['regions'])} region(s)" in note and "each ran" in note
    # a plan made for another model is refused; the plan file is never an output
    other = tmp_path / "other.json"
    cli_json("plan", "--hf-config", str(FIXTURES / "bert-tiny.json"), "--fake", "--budget", "90%", "--save", str(other))
    code, out, err = cli("trace", "--model", "gpt-tiny", "--plan", str(other))
    assert code == 2 and out == "" and "does not have" in err
    before = saved.read_bytes()
    code, _, err = cli("trace", "--model", "gpt-tiny", "--plan", str(saved), "--export-json", str(saved))
    assert code == 2 and "refusing to overwrite" in err and saved.read_bytes() == before


SHARED_BLOCK = """
import torch
from torch import nn
from trainledger.workload import Workload


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(20, 64)
        self.block = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.out = nn.Linear(64, 1)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.block(h)
        h = h + self.block(h)
        return self.out(h).square().mean()


def make():
    torch.manual_seed(0)
    return Workload(Twice(), torch.randn(32, 20))
"""


def test_pareto_where_no_plan_lowers_the_peak_is_one_row(cli_json, tmp_path):
    """A block called twice, whose recomputation only adds: the floor is the plain peak, and the curve is that
    one point (it was eight identical rows)."""
    f = tmp_path / "twice.py"
    f.write_text(SHARED_BLOCK)
    d = cli_json("pareto", "--model", f"{f}:make", "--cost", "flops")
    assert d["floor_bytes"] == d["plain_peak_bytes"]
    assert [r["budget_bytes"] for r in d["rows"]] == [d["plain_peak_bytes"]]


COUNTING = """
import torch
from torch import nn
from trainledger import Workload


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1  # Python state: a recomputation sees another value than the forward did
        return x + self.down(torch.tanh(self.up(x))) * (1 + self.calls % 2)


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Block(), Block())
    return Workload(model, torch.randn(512, 8), loss_fn=lambda out, _batch: out.square().mean())
"""


@pytest.mark.slow
def test_a_plan_that_fails_its_verification_is_not_written(cli, tmp_path):
    """A block whose forward reads Python state it changes computes another thing when recomputed: the
    gradients differ, ``plan --verify`` exits 1, and neither ``--save`` nor ``--export-policy`` writes a plan
    a training loop would then apply."""
    (tmp_path / "counting.py").write_text(COUNTING)
    saved, policy = tmp_path / "plan.json", tmp_path / "remat_policy.py"
    argv = ("plan", "--model", f"{tmp_path / 'counting.py'}:make", "--budget", "85%", "--verify", "--cost", "flops")
    code, out, err = cli(*argv, "--save", str(saved), "--export-policy", str(policy))
    assert code == 1 and ": NO (0 of " in out.split("gradients bitwise equal")[1][:80]
    assert not saved.exists() and not policy.exists()
    assert f"the plan failed its verification: {saved}, {policy} not written" in err


NOISY = """
import torch
from torch import nn
from trainledger import Workload


class NoisyBlock(nn.Module):
    def __init__(self, d, gen):
        super().__init__()
        self.fc1, self.fc2, self.gen = nn.Linear(d, 3 * d), nn.Linear(3 * d, d), gen

    def forward(self, x):
        noise = torch.randn(x.shape, generator=self.gen)  # a generator of its own: checkpoint does not keep it
        return x + self.fc2(torch.tanh(self.fc1(x + 0.1 * noise)))


class CountingBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2, self.calls = nn.Linear(d, 3 * d), nn.Linear(3 * d, d), 0

    def forward(self, x):
        self.calls += 1  # state outside tensors, which the trace cannot see: the recomputation counts again
        return x + self.fc2(torch.tanh(self.fc1(x * self.calls)))


class Net(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x):
        return self.blocks(x).square().mean()


def noisy():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(5)
    return Workload(Net([NoisyBlock(12, gen) for _ in range(3)]), torch.randn(6, 12))


def counting():
    torch.manual_seed(0)
    return Workload(Net([CountingBlock(12) for _ in range(3)]), torch.randn(6, 12))
"""


@pytest.mark.slow
def test_pareto_verify_fails_as_plan_verify_does(cli, tmp_path):
    """A plan that fails its verification (here: a block counting its calls in a Python attribute, which the trace
    cannot see and the recomputation counts again) is an exit status 1 for ``pareto --verify`` too, naming the
    budgets; it was 0."""
    f = tmp_path / "noisy.py"
    f.write_text(NOISY)
    code, out, err = cli("pareto", "--model", f"{f}:counting", "--budgets", "2", "--verify")
    assert code == 1, err
    assert "plans failed their verification" in err and "grads equal" in out


@pytest.mark.slow
def test_a_block_drawing_from_a_generator_of_its_own_is_not_recomputed_and_verifies(cli, tmp_path):
    """Checkpointing keeps the default generators' state only: a recomputed block drawing from the model's own
    generator drew other noise (gradients differed by up to 7e-4), and ``--verify`` failed even the empty plan,
    as it reseeded the default generator alone. Such blocks are not candidates, and the check restores every
    generator the modules hold."""
    f = tmp_path / "noisy.py"
    f.write_text(NOISY)
    code, _, err = cli("plan", "--model", f"{f}:noisy", "--budget", "80%")
    assert code == 2 and "draw random numbers from a torch.Generator of their own" in err and "blocks.0" in err
    code, out, err = cli("plan", "--model", f"{f}:noisy", "--budget", "100%", "--verify")
    assert code == 0, err
    assert "gradients bitwise equal to the plain step's (same seed, cpu, dropout on): yes" in out
