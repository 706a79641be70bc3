"""Stacked traces of architectures outside the analytic families, and the guard against patterns that the
traced depths cannot show.

The oracle is the full fake trace at the same depth, as in ``test_stack.py``: the extended ledger must equal it
event for event, entry for entry and call for call. A model whose blocks differ only past the traced depths
(every fifth block wider) must be traced whole, and the ledger it gets must be the full trace.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.test_stack import assert_same_ledger, cli_extended_and_full
from trainledger.trace import trace, trace_stacked
from trainledger.trace._stack import Stack
from trainledger.workload import Workload

HF = Path(__file__).parent / "fixtures" / "hf"


def test_the_modules_above_the_list_are_the_skeleton():
    stack = Stack("bert.encoder.layer")
    assert stack.encloses("(root)") and stack.encloses("bert") and stack.encloses("bert.encoder")
    assert not stack.encloses("bert.encoder.layer.1") and not stack.encloses("bert.embeddings")
    assert not stack.encloses("ber")
    assert stack.encloses("bert.encoder.layer")  # the list itself, called where it is an nn.Sequential


# --- any transformers architecture with one stack of blocks ------------------------------------------------

_TEXT = {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}
ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # BERT's encoder runs block 0's ops first: its call starts inside block 0 (was traced whole)
    "bert": ("bert", "BertForMaskedLM", {**_TEXT, "max_position_embeddings": 128}),
    # OPT's last sweep is over the blocks (master copies written back): gradients freed when the step ends
    "opt": ("opt", "OPTForCausalLM", {**_TEXT, "ffn_dim": 128, "word_embed_proj_dim": 64}),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", {**_TEXT, "num_key_value_heads": 2, "head_dim": 16}),
    "distilbert": (
        "distilbert",
        "DistilBertForMaskedLM",
        {"vocab_size": 256, "dim": 64, "n_heads": 4, "hidden_dim": 128},
    ),
    "deit": (
        "deit",
        "DeiTForImageClassification",
        {"image_size": 32, "patch_size": 8, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128},
    ),
    "bart": (
        "bart",
        "BartForConditionalGeneration",
        {
            "vocab_size": 256,
            "d_model": 64,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 128,
            "decoder_ffn_dim": 128,
            "decoder_layers": 2,
        },
    ),
    # T5's block 0 computes the relative position bias every block adds: its gradient is summed from the last
    # block down to block 0 (one event more in the blocks between), a lifetime from one end of the stack to the other
    "t5": (
        "t5",
        "T5ForConditionalGeneration",
        {
            "vocab_size": 256,
            "d_model": 64,
            "d_kv": 16,
            "d_ff": 128,
            "num_heads": 4,
            "feed_forward_proj": "gated-gelu",
            "num_decoder_layers": 2,
        },
    ),
}
# the two fixes this file was written for; T5 (the third) and the others run in the whole suite
FAST = ("bert", "opt")


def _any_builder(name: str, num_layers: int) -> tuple[Any, Any]:
    """``build(d)`` of the architecture's step on fake tensors, and ``skeleton(d)`` on the meta device."""
    from transformers import AutoConfig

    from trainledger.analytic import Setup
    from trainledger.anymodel import at_depth, depth_of, load_any_config, skeleton, workload_from_any_config

    model_type, architecture, sizes = ARCHS[name]
    made = AutoConfig.for_model(model_type, **sizes, num_hidden_layers=num_layers)
    cfg = load_any_config({**made.to_dict(), "architectures": [architecture]})
    depth = depth_of(cfg)
    assert depth is not None and depth.num_layers == num_layers and depth.uneven is None
    setup = Setup(micro_batch=2, seq_len=32)
    return (
        lambda d: workload_from_any_config(at_depth(cfg, depth, d), setup, fake=True),
        lambda d: skeleton(at_depth(cfg, depth, d)),
    )


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in ARCHS])
def test_any_architecture_extends_to_the_full_fake_trace(name: str):
    pytest.importorskip("transformers")
    build, skeleton = _any_builder(name, 7)
    assert_same_ledger(trace_stacked(build, 7, skeleton=skeleton), trace(build(7), fake=True))


def test_layers_that_differ_by_setting_are_known_before_tracing():
    pytest.importorskip("transformers")
    from trainledger.anymodel import depth_of, load_any_config

    gemma2 = {"model_type": "gemma2", **_TEXT, "num_hidden_layers": 6, "num_key_value_heads": 2, "head_dim": 16}
    depth = depth_of(load_any_config(gemma2))  # its config class alternates sliding and full attention
    assert depth is not None and depth.uneven == "its layers differ (layer_types)"
    clip = json.loads((HF / "clip-tiny.json").read_text())
    assert depth_of(load_any_config(clip)) is None  # two towers, each its own depth


# --- a pattern that only the full depth shows ------------------------------------------------------------


class _Every5th(nn.Module):
    """Residual blocks, every fifth one with a wider hidden layer: blocks 0-3 look alike."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 64 if i % 5 == 4 else 32), nn.GELU(), nn.Linear(64 if i % 5 == 4 else 32, 16))
            for i in range(depth)
        )
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h).pow(2).mean()


def _every5th(depth: int) -> Workload:
    torch.manual_seed(0)
    return Workload(_Every5th(depth), (torch.randn(4, 8),), optimizer=lambda ps: torch.optim.AdamW(ps), name="every5th")


def test_blocks_unlike_past_the_traced_depths_are_traced_whole():
    full = trace(_every5th(7))
    blind = trace_stacked(_every5th, 7, fake=False)  # 3 and 4 blocks agree, so the extension is wrong
    assert blind.meta["blocks"]["extended"] is True and blind.entries != full.entries
    guarded = trace_stacked(_every5th, 7, fake=False, skeleton=lambda d: _Every5th(d))
    assert guarded.meta["blocks"] == {"total": 7, "traced": [7], "extended": False}
    assert guarded.notes[0].startswith(
        "traced all 7 blocks (not extended: its blocks differ: blocks.4 is not like the traced block 1 "
        "(0's parameters or buffers differ))"
    )
    assert guarded.entries == full.entries and guarded.peak() == full.peak()


# --- timm: a model whose depth argument sets its one list of blocks -----------------------------------------

VIT = "vit_tiny_patch16_224"


def _timm() -> Any:
    try:
        import timm
    except Exception:  # timm imports torchvision, whose wheel must match the installed torch
        pytest.skip("timm (with a torchvision matching this torch) is not installed")
    return timm


def _timm_builder(name: str) -> tuple[Any, Any]:
    """``build(d)`` of a timm classifier's step on 32-pixel images, on fake tensors, and ``skeleton(d)``."""
    from trainledger.analytic import Setup
    from trainledger.vision import timm_skeleton, workload_from_timm

    setup = Setup(micro_batch=2, recipe="fp32")
    return (
        lambda d: workload_from_timm(name, setup, image_size=32, fake=True, depth=d),
        lambda d: timm_skeleton(name, image_size=32, depth=d),
    )


def test_timm_vit_extends_to_the_full_fake_trace():
    _timm()
    from trainledger.vision import timm_depth

    assert timm_depth(VIT, image_size=32) == 12  # model.blocks, as timm's depth=12 builds it
    build, skeleton = _timm_builder(VIT)
    assert_same_ledger(trace_stacked(build, 7, skeleton=skeleton), trace(build(7), fake=True))


def test_timm_nets_without_one_depth_set_list_are_traced_whole():
    _timm()
    from trainledger.vision import timm_depth

    assert timm_depth("resnet18") is None  # stages of their own depths; no depth argument
    assert timm_depth("convnext_atto") is None  # the same, with depths=(2, 2, 6, 2)


def test_timm_drop_path_schedules_are_refused_by_the_skeleton():
    timm = _timm()
    from trainledger.trace import EmptyWeights
    from trainledger.trace._blocks import blocks_differ

    def vit(depth: int) -> nn.Module:  # stochastic depth: each block's rate grows with its index
        with EmptyWeights():
            return timm.create_model(VIT, pretrained=False, img_size=32, depth=depth, drop_path_rate=0.1)

    why = blocks_differ(vit(7), vit(3), 7, 3)
    assert why is not None and why.startswith("its blocks differ: blocks.1 is not like the traced block 1")


# --- the command ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_extends_bert_and_equals_the_full_depth(tmp_path: Path, cli_json):
    pytest.importorskip("transformers")
    cfg = {**json.loads((HF / "bert-tiny.json").read_text()), "num_hidden_layers": 6}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    before = path.read_bytes()
    argv = ("trace", "--hf-config", str(path), "--fake", "--seq-len", "16")
    note = "traced 3 of 6 blocks, extended: the block stack (bert.encoder.layer)"
    extended, full = cli_extended_and_full(cli_json, argv, 6, note)
    assert extended["num_params"] == full["num_params"]
    assert path.read_bytes() == before


def test_cli_extends_a_timm_vit_and_equals_the_full_depth(cli_json):
    _timm()
    argv = ("trace", "--timm", VIT, "--fake", "--image-size", "32", "--micro-batch", "2", "--dtype", "fp32")
    note = "traced 3 of 12 blocks, extended: the block stack (inner.blocks)"
    extended, full = cli_extended_and_full(cli_json, argv, 12, note)
    assert "blocks" not in full["meta"]
    assert extended["num_params"] == full["num_params"]


def test_cli_traces_a_timm_net_of_stages_whole(cli_json):
    _timm()
    out = cli_json("trace", "--timm", "resnet18", "--fake", "--image-size", "32", "--micro-batch", "2")
    assert "blocks" not in out["meta"]  # as before: no stacked trace tried, no note of one
    assert not [n for n in out["notes"] if n.startswith(("traced 3 of", "traced all"))]


def test_a_model_that_cannot_be_built_as_shallow_as_the_traces_is_traced_whole():
    from trainledger.errors import InputError

    def skeleton(d: int) -> nn.Module:
        if d < 7:
            raise InputError("per-layer settings name 7 layers")
        return _Every5th(d)

    led = trace_stacked(_every5th, 7, fake=False, skeleton=skeleton)
    assert led.notes[0].startswith(
        "traced all 7 blocks (not extended: it cannot be built 3 blocks deep: per-layer settings name 7 layers)"
    )
    assert led.entries == trace(_every5th(7)).entries
