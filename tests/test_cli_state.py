"""`trainledger state` and `demo` as a user runs them; every bad input is one line and exit status 2."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_subprocess


def test_seed_json_reports_the_seeds_numbers(cli_json):
    d = cli_json("state", "--model", "seed-423")
    for key in ("schema", "evidence", "device", "peak", "category_maxima", "sum_of_category_maxima"):
        assert key in d
    assert d["by_category"]["weights"] == 3384
    assert d["by_category"]["frozen"] == 3384
    assert [a["running_total"] for a in d["payload"]["arrays"]] == [3384, 6768, 10152, 13536]
    assert [a["label"] for a in d["payload"]["arrays"]] == [
        "weights",
        "optimizer:exp_avg",
        "optimizer:exp_avg_sq",
        "gradients",
    ]
    assert d["num_params"] == 423
    # the frozen reference has all 423 elements: full-length, just not training state of the P parameters
    assert d["payload"]["full_length_not_in_formula"] == ["frozen:reference"]
    assert d["payload"]["excluded"] == ["optimizer:step"]
    assert d["num_autograd_graph_nodes"] == 13
    assert d["recovery_checkpoint"]["bytes"] == 10168


def test_declared_engineering_example(cli_json):
    base = ["state", "--params", "1e9", "--weights", "bf16", "--grads", "bf16", "--optimizer", "adamw"]
    d = cli_json(*base, "--moments", "fp32")
    assert d["peak"]["bytes"] == 12 * 10**9 and d["evidence"] == "declared"
    assert {a["label"]: a["bytes_per_param"] for a in d["payload"]["arrays"]} == {
        "weights": 2,
        "optimizer:exp_avg": 4,
        "optimizer:exp_avg_sq": 4,
        "gradients": 2,
    }
    assert "activations" in d["notes"][0]
    d = cli_json(*base, "--moments", "fp32", "--master", "fp32")
    assert d["peak"]["bytes"] == 16 * 10**9
    # no frozen weights, given as the default it is: the same result
    assert cli_json(*base, "--moments", "fp32", "--frozen-params", "0") == cli_json(*base, "--moments", "fp32")
    assert cli_json(*base, "--frozen-params", "1e9")["peak"]["bytes"] == 14 * 10**9  # + 1e9 bf16 weights


def test_human_table_names_units_and_exclusions(cli):
    code, out, _ = cli("state", "--params", "1e9", "--optimizer", "adamw")
    assert code == 0
    assert "12.00 GB" in out and "GiB = 2^30" in out and "excluded" in out


@pytest.mark.slow  # traces a real GPT step
def test_demo_runs(cli):
    code, out, err = cli("demo")
    assert code == 0, err
    assert "13,536" in out and "10,152" in out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["state", "--model", "nope"], "unknown model 'nope'"),
        (["state", "--model", "missing.py:make"], "does not exist"),
        (["state", "--model", "tests:make"], "is a folder; give the Python file in it"),
        (["state", "--params", "1e9", "--weights", "fp12"], "unknown dtype 'fp12'"),
        (["state", "--params", "1e9", "--optimizer", "sgdx"], "unknown optimizer 'sgdx'"),
        (["state", "--params", "-5"], "--params"),
        (["state", "--params", "0"], "--params"),
        (["state", "--params", "lots"], "--params"),
        (["state"], "give --model"),
        (["state", "--model", "mlp", "--params", "5"], "not both"),
    ],
)
def test_bad_input_is_one_line_exit_2(cli, argv, fragment):
    code, out, err = cli(*argv)
    assert code == 2
    assert fragment in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


FACTORIES = """
import torch, trainledger
NUMBER = 3
def good():
    return trainledger.Workload(torch.nn.Linear(3, 1), torch.randn(4, 3), loss_fn=lambda o, b: o.sum())
def raises():
    raise RuntimeError("no GPU here")
def wrong():
    return 42
def exits():
    import sys
    sys.exit(3)
"""


@pytest.mark.parametrize(
    ("factory", "code", "fragment"),
    [
        ("good", 0, ""),
        ("raises", 2, "raises() raised RuntimeError: no GPU here"),
        ("wrong", 2, "returned int"),
        ("absent", 2, "has no function 'absent'"),
        ("NUMBER", 2, "has 'NUMBER' as an int 3, not a function"),
        ("exits", 2, "exits() called sys.exit(3); a model file and its factory must return, not exit"),
    ],
)
def test_user_factories(cli, tmp_path, factory, code, fragment):
    f = tmp_path / "mine.py"
    f.write_text(FACTORIES)
    before = f.read_text()
    status, out, err = cli("state", "--model", f"{f}:{factory}")
    assert status == code, err
    assert fragment in err
    assert f.read_text() == before  # nothing the user gave is modified


def test_the_real_entry_point_prints_no_traceback():
    proc = run_subprocess("state", "--model", "nope")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_a_file_that_exits_while_imported_is_reported(cli, tmp_path):
    f = tmp_path / "quits.py"
    f.write_text("import sys\nsys.exit('bye')\n")
    status, _, err = cli("state", "--model", f"{f}:make")
    assert status == 2 and "called sys.exit('bye')" in err and len(err.strip().splitlines()) == 1


def test_a_factory_file_imports_its_sibling_modules_and_sys_path_is_restored(cli, tmp_path):
    import sys

    (tmp_path / "sibling_layers.py").write_text("import torch\ndef layer():\n    return torch.nn.Linear(3, 1)\n")
    (tmp_path / "uses_sibling.py").write_text(
        "import torch, trainledger\nfrom sibling_layers import layer\n"
        "def make():\n    return trainledger.Workload(layer(), torch.randn(4, 3), loss_fn=lambda o, b: o.sum())\n"
    )
    before = list(sys.path)
    try:
        status, out, err = cli("state", "--model", f"{tmp_path / 'uses_sibling.py'}:make", "--json")
        assert status == 0, err
        assert sys.path == before
    finally:
        sys.modules.pop("sibling_layers", None)


NOISY = """
import torch
from trainledger.workload import Workload


class Loud(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        print("forward ran")
        return self.fc(x).sum()


def make():
    print("building the model")
    return Workload(Loud(), torch.randn(2, 4))
"""


@pytest.mark.parametrize("command", ["state", "trace"])
def test_what_the_users_code_prints_never_breaks_the_json(cli, tmp_path, command):
    f = tmp_path / "noisy.py"
    f.write_text(NOISY)
    code, out, err = cli(command, "--model", f"{f}:make", "--json")
    assert code == 0, err
    assert json.loads(out)["peak"]["bytes"] > 0  # stdout is the one JSON object
    assert "building the model" in err and (command == "state" or "forward ran" in err)
    code, out, _ = cli(command, "--model", f"{f}:make")  # without --json the prints stay where they were
    assert code == 0 and "building the model" in out
