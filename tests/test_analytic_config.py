"""Config validation: every bad value is one line naming it; defaults equal transformers' own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainledger.analytic import FAMILIES, arch_from_config, load_config_file
from trainledger.analytic._config import DEFAULTS
from trainledger.errors import InputError

LLAMA = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"model_type": None}, "missing key 'model_type'"),
        ({"model_type": "bert"}, "unknown model_type 'bert'"),
        ({"hidden_size": None}, "missing key(s) 'hidden_size'"),
        ({"num_attention_heads": 5}, "num_attention_heads 5 does not divide the hidden size 64"),
        ({"num_hidden_layers": 0}, "'num_hidden_layers' is 0; it must be positive"),
        ({"vocab_size": -3}, "'vocab_size' is -3; it must be positive"),
        ({"intermediate_size": 1.5}, "'intermediate_size' is 1.5; it must be a whole number"),
        ({"hidden_size": True}, "'hidden_size' is True"),
        ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
        ({"attention_dropout": 1.5}, "'attention_dropout' is 1.5; a dropout probability"),
        ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' is 'yes'"),
        ({"hidden_act": "swishy"}, "activation 'swishy' is not in the closed form"),
        # switches and rope settings as Python would read them: "false" is true, and "half" no number
        ({"attention_bias": "false"}, "'attention_bias' is 'false'; it must be true or false"),
        ({"mlp_bias": 1}, "'mlp_bias' is 1; it must be true or false"),
        ({"rope_scaling": "yes"}, "'rope_scaling' is 'yes'; it must be an object of rope settings"),
        ({"rope_parameters": [1]}, "'rope_parameters' is [1]; it must be an object of rope settings"),
    ],
)
def test_bad_configs_name_the_bad_value(change, fragment):
    cfg = {**LLAMA, **change}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(InputError) as exc:
        arch_from_config(cfg)
    assert fragment in str(exc.value)


def test_an_odd_rotary_width_is_refused_as_transformers_cannot_run_it():
    """Phi turns int(head_dim × partial_rotary_factor) features; an odd count (64 × 0.4 → 25) fails inside
    transformers' attention (its cos/sin are 26 wide), so the estimate refuses it rather than answer."""
    import transformers

    cfg = {
        "model_type": "phi",
        **dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2),
        "partial_rotary_factor": 0.4,
    }
    with pytest.raises(InputError, match="rotary embedding is 25 wide"):
        arch_from_config(cfg)
    model = transformers.PhiForCausalLM(transformers.PhiConfig(**{k: v for k, v in cfg.items() if k != "model_type"}))
    with pytest.raises(RuntimeError, match="must match the size"):
        model(torch.zeros(1, 4, dtype=torch.long))
    assert arch_from_config({**cfg, "partial_rotary_factor": 0.5}).rotary_dim == 32


def test_mixture_of_experts_checks_top_k():
    cfg = {**LLAMA, "model_type": "mixtral", "num_key_value_heads": 2, "num_local_experts": 2, "num_experts_per_tok": 3}
    with pytest.raises(InputError, match="num_experts_per_tok 3 exceeds num_local_experts 2"):
        arch_from_config(cfg)


def test_gpt2_accepts_its_own_and_the_standard_names():
    own = arch_from_config({"model_type": "gpt2", "vocab_size": 100, "n_embd": 32, "n_layer": 2, "n_head": 4})
    std = arch_from_config(
        {"model_type": "gpt2", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    )
    assert own == std
    assert own.intermediate_size == 4 * 32 and own.tied and own.learned_positions == 1024


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"model_type": "llama",', "is not valid JSON"),
        ("[1, 2]", "holds a JSON list; give an object"),
    ],
)
def test_file_errors(tmp_path, text, fragment):
    f = tmp_path / "config.json"
    f.write_text(text)
    with pytest.raises(InputError, match=fragment):
        load_config_file(f)
    with pytest.raises(InputError, match=fragment):
        load_config_file(tmp_path)  # a folder holding config.json


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        load_config_file(tmp_path / "nope.json")


def test_folder_is_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert load_config_file(tmp_path) == LLAMA


@pytest.mark.parametrize("family", FAMILIES)
def test_defaults_are_transformers_defaults(family):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(family)
    num_checked = 0
    for key, value in DEFAULTS[family].items():
        if key in ("rotary_pct", "partial_rotary_factor"):
            actual = config.rope_parameters.get("partial_rotary_factor")
        elif key == "n_inner" or not hasattr(config, key):
            continue
        else:
            actual = getattr(config, key)
        assert actual == value, (family, key, actual, value)
        num_checked += 1
    assert num_checked > 0, f"no default of {family} is an attribute of transformers' config: nothing checked"


PHI = {**LLAMA, "model_type": "phi", "intermediate_size": 128}


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"partial_rotary_factor": "half"}, "'partial_rotary_factor' is 'half'"),
        ({"partial_rotary_factor": float("nan")}, "'partial_rotary_factor' is nan"),
        ({"partial_rotary_factor": -1}, "'partial_rotary_factor' is -1"),
        ({"partial_rotary_factor": 1.5}, "'partial_rotary_factor' is 1.5"),
        ({"rope_scaling": {"partial_rotary_factor": "0.5"}}, "'rope_scaling.partial_rotary_factor' is '0.5'"),
        ({"rope_parameters": {"partial_rotary_factor": True}}, "'rope_parameters.partial_rotary_factor' is True"),
        ({"qk_layernorm": "no"}, "'qk_layernorm' is 'no'; it must be true or false"),
    ],
)
def test_a_rotary_fraction_or_switch_that_is_no_number_or_boolean_is_refused(change, fragment):
    """A traceback before (``float('half')``, ``int(nan)``), or an answer for a negative fraction."""
    with pytest.raises(InputError) as exc:
        arch_from_config({**PHI, **change})
    message = str(exc.value)
    assert fragment in message and ("above 0 and at most 1" in message or "true or false" in message), message
    fine = arch_from_config({**PHI, "rope_scaling": {"partial_rotary_factor": None}, "partial_rotary_factor": 0.5})
    assert fine.rotary_dim == 8  # a null in rope_scaling is the family's key: 16-wide heads × 0.5


def test_a_gpt2_with_cross_attention_is_refused_by_the_closed_form_and_traced_whole(cli, cli_json, tmp_path):
    """Its layers hold cross-attention weights the closed form had no count for: estimate answered 21% low.
    The trace builds it whole, and its parameters are transformers' own."""
    transformers = pytest.importorskip("transformers")
    cfg = {"model_type": "gpt2", "vocab_size": 96, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg, "add_cross_attention": True}))
    code, _, err = cli("estimate", "--hf-config", str(path), "--seq-len", "16")
    assert code == 2 and "'add_cross_attention' is true" in err and "trace --hf-config CONFIG --fake" in err
    traced = cli_json("trace", "--hf-config", str(path), "--seq-len", "16", "--micro-batch", "1", "--fake")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg, add_cross_attention=True))
    assert traced["num_params"] == sum(p.numel() for p in model.parameters())


def test_a_config_that_is_no_regular_file_or_far_too_large_is_refused_unread(tmp_path):
    """``/dev/zero`` was read until the process ran out of memory."""
    if Path("/dev/zero").exists():
        with pytest.raises(InputError, match="is not a regular file"):
            load_config_file("/dev/zero")
    big = tmp_path / "config.json"
    with big.open("wb") as f:
        f.truncate(17 * 2**20)  # sparse: nothing is written
    with pytest.raises(InputError, match=r"17,825,792 bytes; a config\.json is a few KB"):
        load_config_file(big)
