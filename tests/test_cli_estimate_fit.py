"""`trainledger estimate` and `fit` as a user runs them; every bad input is one line and exit status 2."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from trainledger.analytic import Setup, arch_from_config, num_params
from trainledger.analytic._model import analytic_ledger
from trainledger.shard import ShardConfig, shard

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
LLAMA7B = str(FIXTURES / "llama-2-7b.json")
LLAMA3 = str(FIXTURES / "llama-3-8b.json")


def test_estimate_json_holds_the_common_keys_and_exact_counts(cli_json):
    d = cli_json("estimate", "--hf-config", LLAMA7B, "--seq-len", "4096")
    for key in ("schema", "evidence", "device", "peak", "category_maxima", "sum_of_category_maxima", "num_params"):
        assert key in d
    assert d["evidence"] == "analytic"
    assert d["num_params"] == 6_738_415_616
    assert set(d["peak"]) >= {"bytes", "event", "phase", "by_category"}
    assert sum(d["peak"]["by_category"].values()) == d["peak"]["bytes"]


def test_estimate_hand_check_of_persistent_state():
    """bf16-master AdamW: weights 2P, master 4P, moments 8P (+4 bytes of step per tensor), all exact."""
    spec = arch_from_config(json.loads(Path(LLAMA7B).read_text()))
    led = analytic_ledger(spec, Setup(micro_batch=1, seq_len=4096))
    P = num_params(spec)
    by = {k[0]: v for k, v in led.bytes_by("category", entries=[e for e in led.entries if e.persistent]).items()}
    assert by["weights"] == 2 * P
    assert by["optimizer"] == 12 * P + 4 * 291  # 291 parameter tensors in Llama-2-7B
    pk = led.peak()
    assert pk.by_category["weights"] == 2 * P and pk.by_category["gradients"] == 6 * P  # bf16 grads + fp32 copies


def test_estimate_world_and_stage_divide_through_the_shard_transform(cli_json):
    argv = ("estimate", "--hf-config", LLAMA3, "--seq-len", "4096", "--world", "8")
    zero = {s: cli_json(*argv, "--stage", str(s)) for s in (0, 1, 2, 3)}
    peaks = [zero[s]["peak"]["bytes"] for s in (0, 1, 2, 3)]
    assert peaks == sorted(peaks, reverse=True) and peaks[3] < peaks[0] / 2
    spec = arch_from_config(json.loads(Path(LLAMA3).read_text()))
    led = analytic_ledger(spec, Setup(micro_batch=1, seq_len=4096))
    expected = shard(led, ShardConfig(world_size=8, strategy="zero3", engine="deepspeed")).ranks[0].peak().bytes
    assert zero[3]["peak"]["bytes"] == expected
    assert zero[3]["num_params"] == 8_030_261_248


def test_estimate_remat_and_parallelism_reduce_activations(cli_json):
    base = ("estimate", "--hf-config", LLAMA7B, "--seq-len", "4096", "--micro-batch", "4", "--dtype", "bf16")
    act = {}
    for name, extra in {
        "none": (),
        "full": ("--remat", "full"),
        "every2": ("--remat", "full", "--remat-every", "2"),
        "tp2": ("--tensor-parallel", "2"),
        "tp2sp": ("--tensor-parallel", "2", "--sequence-parallel"),
    }.items():
        act[name] = cli_json(*base, *extra)["category_maxima"]["activations"]
    assert act["full"] < act["every2"] < act["none"]
    assert act["tp2sp"] < act["tp2"] < act["none"]
    # sequence parallelism splits every saved activation across the two ranks (up to rounding)
    assert abs(act["tp2sp"] - act["none"] / 2) <= 1024


def test_eager_attention_keeps_the_score_matrix(cli_json):
    base = ("estimate", "--hf-config", LLAMA7B, "--seq-len", "2048", "--dtype", "bf16")
    eager = cli_json(*base, "--attn", "eager")["saved_activation_bytes_per_layer"]
    sdpa = cli_json(*base, "--attn", "sdpa")["saved_activation_bytes_per_layer"]
    B, nh, T = 1, 32, 2048
    lse = 4 * B * nh * T
    # eager adds the fp32 softmax and its bf16 cast (T×T per head); both keep q, k, v and the attention output
    # (4 tensors of B·T·4096 bf16); SDPA adds the fp32 log-sum-exp
    assert eager - sdpa == (4 + 2) * B * nh * T * T - lse


def test_estimate_human_output(cli):
    code, out, err = cli("estimate", "--hf-config", LLAMA7B, "--seq-len", "4096")
    assert code == 0, err
    assert "evidence analytic" in out and "6,738,415,616" in out and "GiB = 2^30" in out


def test_fit_answers_with_configurations_that_fit(cli_json):
    d = cli_json(
        "fit",
        "--hf-config",
        LLAMA3,
        "--device-memory",
        "80GiB",
        "--world",
        "8",
        "--seq-len",
        "4096",
        "--traced-top",
        "0",
    )
    assert d["fits"] and d["does_not_fit"]
    assert all(c["traced_peak_bytes"] is None for c in (*d["fits"], *d["does_not_fit"]))  # analytic alone
    usable = 80 * 2**30
    assert all(c["peak_bytes"] <= usable for c in d["fits"])
    assert all(c["peak_bytes"] > usable and c["overflow_bytes"] == c["peak_bytes"] - usable for c in d["does_not_fit"])
    costs = [c["relative_cost"] for c in d["fits"]]
    assert costs[0] == 1.0 and costs == sorted(costs)
    assert all(c["relative_cost"] is None for c in d["does_not_fit"])  # no cost compared, none claimed
    assert d["num_params"] == 8_030_261_248 and d["evidence"] == "analytic"


def test_fit_at_one_rank_tries_one_zero_stage_and_says_why():
    """At one rank every ZeRO stage holds the whole state: four identical rows per configuration were noise."""
    from trainledger import FitOptions, Setup, fit

    options = FitOptions(device_memory=80 * 2**30, micro_batches=(1, 2))
    one = fit(LLAMA3, options, Setup(seq_len=1024))
    assert {c.stage for c in (*one.fitting, *one.overflowing)} == {"zero0"}
    assert any("only ZeRO stage 0 was tried" in n for n in one.notes)
    eight = fit(LLAMA3, replace(options, world=8), Setup(seq_len=1024))
    assert {c.stage for c in eight.fitting} == {"zero0", "zero1", "zero2", "zero3"}
    assert not any("ZeRO stage" in n for n in eight.notes)
    only_zero0 = fit(LLAMA3, replace(options, stages=("zero0",)), Setup(seq_len=1024))
    assert [c.key for c in one.fitting] == [c.key for c in only_zero0.fitting] and not only_zero0.notes


def test_fit_on_a_tiny_device_says_nothing_fits(cli):
    code, out, err = cli("fit", "--hf-config", LLAMA7B, "--device-memory", "8GiB", "--micro-batches", "1")
    assert code == 0, err
    assert "nothing fits" in out and "over by" in out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["estimate", "--hf-config", "missing.json"], "no such file"),
        (["estimate", "--hf-config", LLAMA7B, "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
        (["estimate", "--hf-config", LLAMA7B, "--optimizer", "lamb"], "argument --optimizer: invalid choice: 'lamb'"),
        (["estimate", "--hf-config", LLAMA7B, "--attn", "flash"], "argument --attn: invalid choice: 'flash'"),
        (["estimate", "--hf-config", LLAMA7B, "--remat", "some"], "argument --remat: invalid choice: 'some'"),
        (["estimate", "--hf-config", LLAMA7B, "--stage", "5"], "unknown stage '5'"),
        (["estimate", "--hf-config", LLAMA7B, "--stage", "full_shard"], "ZeRO stages 0, 1, 2, 3"),
        (["estimate", "--hf-config", LLAMA7B, "--micro-batch", "0"], "argument --micro-batch: 0 must be at least 1"),
        (["estimate", "--hf-config", LLAMA7B, "--seq-len", "-4"], "--seq-len"),
        (["estimate", "--hf-config", LLAMA7B, "--world", "0"], "argument --world: 0 must be at least 1"),
        (["estimate", "--hf-config", LLAMA7B, "--tensor-parallel", "3"], "does not divide the 32 key/value heads"),
        (["estimate", "--hf-config", LLAMA7B, "--pipeline-parallel", "64"], "exceeds the model's 32 layers"),
        (["estimate", "--hf-config", LLAMA7B, "--device-kind", "tpu"], "argument --device-kind: invalid choice: 'tpu'"),
        (["estimate", "--hf-config", LLAMA7B, "--lora-rank", "8", "--lora-targets", "query"], "it has: down_proj"),
        (["estimate", "--hf-config", LLAMA7B, "--lora-rank", "-2"], "argument --lora-rank: -2 must be at least 0"),
        (["estimate", "--hf-config", LLAMA7B, "--lora-rank", "8", "--lora-targets", ","], "names no linear"),
        (["estimate", "--hf-config", LLAMA7B, "--lora-rank", "4097"], "give a rank up to 4,096"),  # hidden 4096
        (["trace", "--hf-config", LLAMA7B, "--fake", "--lora-rank", "4097"], "give a rank up to 4,096"),
        (["trace", "--hf-config", LLAMA7B, "--fake", "--optimizer", "sgd"], "give the fp32 or bf16 recipe"),
        (["estimate", "--hf-config", str(FIXTURES / "gpt2.json"), "--seq-len", "2048"], "1024 learned positions"),
        (["fit", "--hf-config", LLAMA7B, "--device-memory", "lots"], "--device-memory"),
        (["fit", "--hf-config", LLAMA7B, "--device-memory", "80GiB", "--micro-batches", "a,b"], "--micro-batches"),
        (["fit", "--hf-config", LLAMA7B, "--device-memory", "80GiB", "--recipes", "fp4"], "unknown precision recipe"),
        (["fit", "--model", "mlp", "--device-memory", "1GiB"], "not from a model; for your own model use trace"),
        (["estimate", "--model=gpt-tiny"], "estimate works from a Hugging Face config (--hf-config PATH)"),
        (["fit", "--hf-config", LLAMA7B, "--device-memory", "1GiB", "--reserve", "2GiB"], "leaves nothing"),
    ],
)
def test_bad_input_is_one_line_exit_2(cli, argv, fragment):
    code, out, err = cli(*argv)
    assert code == 2
    assert fragment in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"model_type": "llama", "hidden_size": ' + "9" * 5000 + "}", "Exceeds the limit (4300 digits)"),
        ('{"model_type": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests too deeply"),
        ("", "is not valid JSON"),
    ],
)
def test_a_config_no_model_has_is_one_line_exit_2(cli, tmp_path, text, fragment):
    path = tmp_path / "config.json"
    path.write_text(text)
    code, out, err = cli("estimate", "--hf-config", str(path))
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1 and not out, err


@pytest.mark.parametrize("command", ["estimate", "fit"])
@pytest.mark.parametrize("head", ["LlamaForSequenceClassification", "LlamaForTokenClassification", "LlamaModel"])
def test_a_config_of_another_head_is_refused_not_estimated_as_a_causal_lm(cli, tmp_path, command, head):
    """The closed form models the causal-LM head (a 128k-vocabulary projection and its logits on Llama 3): a
    classifier's estimate was a third above its fake trace, its parameter count said exact."""
    cfg = {**json.loads(Path(LLAMA3).read_text()), "architectures": [head]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    memory = ["--device-memory", "80GiB"] if command == "fit" else []
    code, out, err = cli(command, "--hf-config", str(path), *memory)
    assert code == 2 and f"architectures name {head!r}, not a causal language model" in err and not out, err
    assert len(err.strip().splitlines()) == 1


def test_a_config_that_is_a_device_is_refused_unread_not_called_missing(cli):
    code, _, err = cli("estimate", "--hf-config", "/dev/null")
    assert code == 2 and "is not a regular file" in err and "no such file" not in err


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ('{"model_type": "llama", "hidden_size": 64', "is not valid JSON"),
        ('{"hidden_size": 64}', "missing key 'model_type'"),
        ('{"model_type": "t5", "d_model": 512}', "model_type 't5' is outside the analytic model"),
        (
            '{"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 2, '
            '"num_attention_heads": 4}',
            "missing key(s) 'intermediate_size'",
        ),
        (
            '{"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8, '
            '"num_hidden_layers": 2, "num_attention_heads": 6}',
            "num_attention_heads 6 does not divide the hidden size 64",
        ),
        (
            '{"model_type": "gpt2", "vocab_size": 0, "n_embd": 64, "n_layer": 2, "n_head": 4}',
            "'vocab_size' is 0; it must be positive",
        ),
    ],
)
def test_bad_configs_are_one_line_exit_2(cli, tmp_path, content, fragment):
    f = tmp_path / "config.json"
    f.write_text(content)
    commands = [["estimate"], ["fit", "--device-memory", "80GiB"]]
    if "outside the analytic model" not in fragment:  # plan and pareto build any architecture (test_plan_full)
        commands += [["plan", "--fake", "--budget", "60%"], ["pareto", "--fake"]]
    for command in commands:
        code, out, err = cli(*command, "--hf-config", str(f))
        assert code == 2
        assert fragment in err, err
        assert len(err.strip().splitlines()) == 1
    assert f.read_text() == content  # nothing the user gave is modified


def test_a_config_folder_without_a_config_json_is_named_so(cli, tmp_path):
    status, _out, err = cli("estimate", "--hf-config", str(tmp_path))
    assert status == 2 and "holds no config.json" in err and "Traceback" not in err


def test_a_config_whose_model_type_and_architectures_disagree_says_so(cli, tmp_path):
    # a llama config relabelled as another architecture transformers ships: the class it names is not one
    raw = json.loads((FIXTURES / "llama-small.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": "t5"}))
    status, _out, err = cli("trace", "--hf-config", str(tmp_path), "--fake")
    assert status == 2 and "'LlamaForCausalLM', a class of model_type 'llama'" in err and "'t5'" in err


def test_a_rank_s_share_of_the_parameters_is_called_so(cli):
    """Under tensor or pipeline parallelism the trainable count is one rank's share, not the model's."""
    code, out, _ = cli("estimate", "--hf-config", LLAMA7B, "--tensor-parallel", "4", "--pipeline-parallel", "2")
    words = " ".join(out.split())  # as wrapped to the console's width
    assert (
        code == 0 and "on this rank (its tensor-parallel or pipeline share)" in words and "tensor-parallel 4" in words
    )
    code, out, _ = cli("estimate", "--hf-config", LLAMA7B)
    assert code == 0 and "trainable 6,738,415,616 " in " ".join(out.split()) and "on this rank" not in out
