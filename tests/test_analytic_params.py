"""Parameter counts: exact, tensor by tensor, against transformers' own model built on the meta device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainledger.analytic import arch_from_config, num_params, param_tensors

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
SMALL = sorted(FIXTURES.glob("*-small.json"))
FULL = [FIXTURES / "llama-2-7b.json", FIXTURES / "llama-3-8b.json", FIXTURES / "gpt2.json"]


def _meta_counts(cfg: dict) -> dict[str, int]:
    pytest.importorskip("transformers")
    from trainledger.hf import build_model, load_hf_config

    model = build_model(load_hf_config(cfg), device="meta")
    return {n: p.numel() for n, p in model.named_parameters()}


@pytest.mark.parametrize("path", SMALL, ids=lambda p: p.stem)
@pytest.mark.parametrize("tied", [False, True])
def test_small_configs_tied_and_untied_match_transformers(path, tied):
    cfg = {**json.loads(path.read_text()), "tie_word_embeddings": tied}
    ours = {p.name: p.numel for p in param_tensors(arch_from_config(cfg))}
    assert ours == _meta_counts(cfg)


@pytest.mark.parametrize("path", FULL, ids=lambda p: p.stem)
def test_full_size_configs_match_transformers(path):
    cfg = json.loads(path.read_text())
    theirs = _meta_counts(cfg)
    assert num_params(arch_from_config(cfg)) == sum(theirs.values())


def test_published_parameter_counts():
    """The numbers the model cards state (GPT-2 small: 124M with the tied head counted once)."""
    counts = {p.stem: num_params(arch_from_config(json.loads(p.read_text()))) for p in FULL}
    assert counts == {"llama-2-7b": 6_738_415_616, "llama-3-8b": 8_030_261_248, "gpt2": 124_439_808}


def test_hand_count_of_a_tiny_llama():
    """V·H embedding + L·(4H² attention + 3HI MLP + 2H norms) + H final norm + V·H head."""
    V, H, I, L = 100, 8, 24, 2
    cfg = {"model_type": "llama", "vocab_size": V, "hidden_size": H, "intermediate_size": I}
    spec = arch_from_config({**cfg, "num_hidden_layers": L, "num_attention_heads": 2})
    assert num_params(spec) == V * H + L * (4 * H * H + 3 * H * I + 2 * H) + H + V * H
