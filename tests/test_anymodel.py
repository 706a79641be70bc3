"""Architectures outside the analytic families, built by transformers from local configs: the fake trace of
each small config equals its real trace (the oracle: the same step run on real tensors), and bad configs
are one line and exit status 2."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from trainledger.analytic import Setup
from trainledger.cli import main
from trainledger.errors import InputError

pytest.importorskip("transformers")

from trainledger.anymodel import load_any_config, workload_from_any_config

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
TINY = sorted(FIXTURES.glob("*-tiny.json"))


@pytest.mark.slow
@pytest.mark.parametrize("path", TINY, ids=lambda p: p.stem)
def test_fake_trace_equals_real_trace(path):
    from trainledger.trace import trace

    setup = Setup(micro_batch=2, seq_len=32, recipe="fp32")
    real = trace(workload_from_any_config(path, setup))
    fake = trace(workload_from_any_config(path, setup, fake=True), fake=True)
    # the same instant: bytes, breakdown, phase and op; its index may differ by the few ops (no memory) that
    # transformers runs on the real batch to read its padding mask, which a fake trace answers without running
    peak_of = lambda ledger: {k: v for k, v in ledger.peak().to_dict().items() if k != "event"}  # noqa: E731
    assert peak_of(fake) == peak_of(real)
    assert fake.num_params() == real.num_params()
    model = workload_from_any_config(path, setup).model
    assert real.num_params() == sum(p.numel() for p in model.parameters() if p.requires_grad)
    # what the model freezes itself (Whisper's sinusoidal encoder positions) is frozen, not trained
    frozen = sum(e.numel for e in real.select(category="frozen"))
    assert frozen == sum(p.numel() for p in model.parameters() if not p.requires_grad)


@pytest.mark.parametrize(
    ("stem", "task", "shapes"),
    [
        ("bert-tiny", "masked-lm", {"input_ids": (3, 16), "labels": (3, 16)}),
        ("t5-tiny", "seq2seq", {"input_ids": (3, 16), "decoder_input_ids": (3, 16), "labels": (3, 16)}),
        ("bart-tiny", "seq2seq", {"input_ids": (3, 16), "decoder_input_ids": (3, 16), "labels": (3, 16)}),
        ("vit-tiny", "image-classification", {"pixel_values": (3, 3, 32, 32), "labels": (3,)}),
        # transformers lists DeiT's classifier beside its distilled one (two classes for one model_type)
        ("deit-tiny", "image-classification", {"pixel_values": (3, 3, 32, 32), "labels": (3,)}),
        ("segformer-tiny", "semantic-segmentation", {"pixel_values": (3, 3, 32, 32), "labels": (3, 32, 32)}),
        # Whisper: 16 mel bins × 2 frames per each of its 32 encoder positions; the decoder reads the tokens
        (
            "whisper-tiny",
            "speech-seq2seq",
            {"input_features": (3, 16, 64), "decoder_input_ids": (3, 16), "labels": (3, 16)},
        ),
        # 16 frames of audio after a front end striding 5 × 4 × 4 samples; transcripts half as long
        ("wav2vec2-ctc", "ctc", {"input_values": (3, 16 * 80), "labels": (3, 8)}),
        # the Audio Spectrogram Transformer: a spectrogram of its fixed window (48 frames of 32 mel bins)
        ("ast-tiny", "audio-classification", {"input_values": (3, 48, 32), "labels": (3,)}),
        # text and images from the sub-configs; the model's own contrastive loss
        ("clip-tiny", "contrastive", {"input_ids": (3, 16), "pixel_values": (3, 3, 32, 32), "return_loss": True}),
    ],
)
def test_task_and_batch_follow_the_architecture(stem, task, shapes):
    cfg = load_any_config(FIXTURES / f"{stem}.json")
    assert cfg.task == task
    assert cfg.class_name == json.loads((FIXTURES / f"{stem}.json").read_text())["architectures"][0]
    w = workload_from_any_config(cfg, Setup(micro_batch=3, seq_len=16), fake=True)
    assert type(w.model).__name__ == cfg.class_name
    assert {k: tuple(v.shape) if isinstance(v, torch.Tensor) else v for k, v in w.batch.items()} == shapes


@pytest.mark.parametrize(
    ("task", "shapes"),
    [
        ("sequence-classification", {"labels": (2,)}),
        ("token-classification", {"labels": (2, 16)}),
        ("question-answering", {"start_positions": (2,), "end_positions": (2,)}),
        ("causal-lm", {"labels": (2, 16)}),
    ],
)
def test_every_text_task_of_one_family_gets_its_labels(task, shapes):
    cfg = load_any_config(FIXTURES / "bert-tiny.json", task=task)
    w = workload_from_any_config(cfg, Setup(micro_batch=2, seq_len=16))
    assert {k: tuple(v.shape) for k, v in w.batch.items()} == {"input_ids": (2, 16), **shapes}
    out = w.model(**w.batch)
    assert out.loss.ndim == 0 and out.loss.requires_grad  # the model's own loss, from those labels


def test_an_encoder_decoder_classifier_reads_one_end_token_per_row():
    cfg = load_any_config(FIXTURES / "bart-tiny.json", task="sequence-classification")
    w = workload_from_any_config(cfg, Setup(micro_batch=4, seq_len=16))
    ids = w.batch["input_ids"]
    eos = w.model.config.eos_token_id
    assert (ids[:, -1] == eos).all() and ((ids == eos).sum(1) == 1).all()
    assert w.model(**w.batch).loss.requires_grad


def test_an_image_size_reshapes_the_pixels():
    w = workload_from_any_config(FIXTURES / "vit-tiny.json", Setup(micro_batch=2, seq_len=16), image_size=48, fake=True)
    assert tuple(w.batch["pixel_values"].shape) == (2, 3, 48, 48)


def test_remote_code_is_refused_and_its_map_ignored_beside_a_known_type(tmp_path):
    evil = tmp_path / "evil.json"
    evil.write_text(json.dumps({"model_type": "evil", "auto_map": {"AutoModel": "x--y.Z"}}))
    with pytest.raises(InputError, match="remote code"):
        load_any_config(evil)
    cfg = json.loads((FIXTURES / "bert-tiny.json").read_text())
    cfg |= {"auto_map": {"AutoModel": "x--y.Z"}, "quantization_config": {"quant_method": "gptq"}}
    notes = load_any_config(cfg).notes
    assert [n.split(":")[0] for n in notes] == ["auto_map ignored", "quantization_config ignored"]


@pytest.mark.parametrize(
    ("config", "flags", "message"),
    [
        ({"model_type": "nosuch"}, [], "unknown architecture"),
        ({"model_type": "evil", "auto_map": {"AutoModel": "x--y.Z"}}, [], "never runs remote code"),
        (None, ["--task", "seq2seq"], "no seq2seq model for model_type 'bert'"),
        (None, ["--seq-len", "4096"], "above the 128 positions"),
        (None, ["--lora-rank", "4"], "traced plain"),
        ({"model_type": "bert", "architectures": ["BertForTimeTravel"]}, [], "has no model class 'BertForTimeTravel'"),
        # transformers accepts a padding token outside the vocabulary; the embedding refuses it
        (
            {"model_type": "phi3", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 1},
            [],
            "cannot build Phi3ForCausalLM from this config: Padding_idx must be within num_embeddings",
        ),
        # transformers' validators raise huggingface_hub's StrictDataclassError, not a ValueError (a traceback)
        (
            {"model_type": "gpt_neo", "num_layers": 7, "attention_types": [[["global", "local"], 1]]},
            [],
            "transformers rejects the gpt_neo config: Class validation error for validator 'validate_architecture'",
        ),
        # CTC's loss reads its labels' values (their largest, their lengths): not on fake tensors
        ("wav2vec2-ctc", ["--seq-len", "32"], "data-dependent shapes"),
    ],
)
def test_bad_configs_are_one_line_and_exit_2(tmp_path, capsys, config, flags, message):
    path = tmp_path / "config.json"
    fixture = FIXTURES / f"{config or 'bert-tiny'}.json"
    path.write_text(json.dumps(config) if isinstance(config, dict) else fixture.read_text())
    assert main(["trace", "--hf-config", str(path), "--fake", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_estimate_says_only_the_trace_covers_it(capsys):
    assert main(["estimate", "--hf-config", str(FIXTURES / "bert-tiny.json")]) == 2
    assert "only the trace covers it" in capsys.readouterr().err


def test_an_activation_outside_the_closed_form_is_traced_whole_and_only_estimate_refuses(cli_json, cli, tmp_path):
    """A Llama with tanh: transformers trains it, so trace builds it whole (not through the analytic family's
    path, which refused the activation); the fake trace equals the real one, and only estimate refuses."""
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        **dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
        "hidden_act": "tanh",
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    step = ("--hf-config", str(path), "--seq-len", "16", "--micro-batch", "2", "--dtype", "fp32")
    real, fake = cli_json("trace", *step), cli_json("trace", *step, "--fake")
    assert real["peak"] == {**fake["peak"], "event": real["peak"]["event"]} and real["peak"]["bytes"] > 0
    code, _, err = cli("estimate", *step)
    assert code == 2 and "activation 'tanh' is not in the closed form" in err and "trace --hf-config" in err


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_diffusers_fake_trace_equals_real_trace(recipe):
    pytest.importorskip("diffusers")
    from trainledger.trace import trace
    from trainledger.vision import workload_from_diffusers_config

    path = FIXTURES / "sd15-unet-tiny-diffusers.json"
    setup = Setup(micro_batch=2, seq_len=8, recipe=recipe)
    real = trace(workload_from_diffusers_config(path, setup))
    fake = trace(workload_from_diffusers_config(path, setup, fake=True), fake=True)
    assert fake.peak().bytes == real.peak().bytes
    assert fake.num_params() == real.num_params()


def _usable_timm():
    try:
        import timm
    except Exception:  # timm imports torchvision, whose wheel must match the installed torch
        pytest.skip("timm (with a torchvision matching this torch) is not installed")
    return timm


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "resnet18",
        "mobilenetv3_small_050",
        "vit_tiny_patch16_224",  # reads its drop-path schedule with .item() while built: weights on meta
        "convnext_atto",  # the same
    ],
)
def test_timm_fake_trace_equals_real_trace(name):
    timm = _usable_timm()
    if not timm.is_model(name):
        pytest.skip(f"this timm has no {name}")
    from trainledger.trace import trace
    from trainledger.vision import workload_from_timm

    setup = Setup(micro_batch=2, recipe="fp32")
    real_workload = workload_from_timm(name, setup, image_size=64)
    real = trace(real_workload)
    fake_workload = workload_from_timm(name, setup, image_size=64, fake=True)
    fake = trace(fake_workload, fake=True)
    assert fake.num_params() == real.num_params() == sum(p.numel() for p in real_workload.model.parameters())
    assert _entries(fake) == _entries(real) and [e.op for e in fake.events] == [e.op for e in real.events]
    assert fake.peak().bytes == real.peak().bytes and fake.peak().event == real.peak().event
    meta = all(p.is_meta for p in fake_workload.model.parameters())
    assert meta == name.startswith(("vit", "convnext"))  # the others build under FakeTensorMode, as before


@pytest.mark.slow
def test_trace_timm_fake_of_a_vit_on_the_command_line(capsys):
    timm = _usable_timm()
    name = "vit_tiny_patch16_224"
    if not timm.is_model(name):
        pytest.skip(f"this timm has no {name}")
    from trainledger.trace import trace
    from trainledger.vision import workload_from_timm

    argv = ["trace", "--timm", name, "--fake", "--image-size", "64", "--micro-batch", "2", "--dtype", "fp32"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    real = trace(workload_from_timm(name, Setup(micro_batch=2, recipe="fp32"), image_size=64))
    assert (out["peak"]["bytes"], out["peak"]["event"]) == (real.peak().bytes, real.peak().event)


def _entries(led):
    return [(e.name, e.category, e.role, e.dtype, e.shape, e.nbytes, e.alloc_event, e.free_event) for e in led.entries]


def test_a_missing_or_unusable_extra_is_one_line(capsys):
    try:
        import timm  # noqa: F401

        pytest.skip("timm is usable here")
    except Exception:
        pass
    assert main(["trace", "--timm", "resnet50", "--fake"]) == 2
    assert capsys.readouterr().err.strip().endswith("pip install 'trainledger[timm]'")


def test_a_model_that_reads_its_weights_while_built_is_one_line_on_fake_tensors():
    from trainledger.anymodel import build_fake

    class ReadsItsWeight(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(4))
            self.rates = [x.item() for x in torch.linspace(0, 1, 3)]  # readable: computed for real
            self.norm = float(self.scale.sum())  # unreadable: the weight is on meta

    with pytest.raises(InputError, match="reads the values of its weights while it is built") as info:
        build_fake(lambda mode: _built_under(mode, ReadsItsWeight))
    assert "\n" not in str(info.value) and str(info.value).endswith("trace it without --fake")
    assert _built_under(None, ReadsItsWeight).norm == 4.0


def _built_under(mode, cls):
    with mode if mode is not None else contextlib.nullcontext():
        return cls()


@pytest.mark.parametrize(
    ("architecture", "task", "analytic"),
    [
        ("LlamaForCausalLM", "causal-lm", True),
        ("LlamaForSequenceClassification", "sequence-classification", False),
        ("LlamaForQuestionAnswering", "question-answering", False),
    ],
)
def test_a_family_config_naming_another_head_is_built_with_that_head(tmp_path, architecture, task, analytic):
    import argparse

    from trainledger.commands.trace import in_analytic_family

    raw = json.loads((FIXTURES / "llama-small.json").read_text()) | {"architectures": [architecture]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    assert in_analytic_family(argparse.Namespace(task=None, hf_config=str(path))) is analytic
    cfg = load_any_config(path)
    assert (cfg.task, cfg.class_name) == (task, architecture)


def test_small_instance_is_the_architecture_shallow_and_narrow():
    from trainledger.anymodel import build_any_model, small_instance

    cfg = load_any_config(FIXTURES / "bert-large.json")
    small, what = small_instance(cfg)
    model = build_any_model(small)
    assert type(model).__name__ == cfg.class_name
    assert len(model.bert.encoder.layer) == 3 and model.config.hidden_size == 64
    assert model.config.num_attention_heads == 4 and model.config.intermediate_size == 128
    # the vocabulary narrowed to 512 (its special tokens below it): 512 x 64 word embeddings
    assert model.bert.embeddings.word_embeddings.weight.shape == (512, 64)
    assert what == "3 blocks deep, hidden_size 64, intermediate_size 128, num_attention_heads 4, vocab_size 512"
    # an encoder-decoder's second stack is cut too; its key-value width follows the heads
    t5, _ = small_instance(load_any_config(FIXTURES / "t5-base.json"))
    t5_model = build_any_model(t5)
    assert len(t5_model.encoder.block) == 3 and len(t5_model.decoder.block) == 3
    assert t5_model.config.d_model == 64 and t5_model.config.num_heads * t5_model.config.d_kv == 64


def test_small_instance_keeps_widths_a_narrower_config_cannot_build_with():
    from trainledger.anymodel import build_any_model, small_instance

    raw = {"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 256, "hidden_size": 96,
           "num_hidden_layers": 6, "num_attention_heads": 3, "intermediate_size": 128}  # fmt: skip
    # hidden 64 with 3 heads does not divide: only the depth is cut
    small, what = small_instance(load_any_config(raw))
    model = build_any_model(small)
    assert len(model.bert.encoder.layer) == 3 and model.config.hidden_size == 96
    assert what == "3 blocks deep, its widths the config's (a narrower one does not run)"


def test_small_instance_narrows_each_tower_of_an_image_text_model():
    from trainledger.anymodel import build_any_model, small_instance

    tower = {"hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 8, "num_hidden_layers": 6}
    raw = {"model_type": "siglip", "architectures": ["SiglipModel"],
           "text_config": {**tower, "vocab_size": 256, "projection_size": 256, "max_position_embeddings": 64},
           "vision_config": {**tower, "image_size": 32, "patch_size": 8}}  # fmt: skip
    small, what = small_instance(load_any_config(raw))
    model = build_any_model(small)
    for name in ("text_config", "vision_config"):
        sub = getattr(model.config, name)
        assert (sub.hidden_size, sub.num_hidden_layers, sub.num_attention_heads) == (64, 3, 4), name
    # the text tower's projection follows its width, so that text and image embeddings still meet
    assert model.config.text_config.projection_size == 64 and "text_config.projection_size 64" in what
    assert what.startswith("text_config.num_hidden_layers 3, vision_config.num_hidden_layers 3")


def test_small_instance_keeps_the_ratio_of_key_value_heads_whatever_the_config_calls_them():
    from trainledger.anymodel import build_any_model, small_instance

    raw = {"model_type": "falcon", "architectures": ["FalconForCausalLM"], "vocab_size": 1000, "hidden_size": 1024,
           "num_hidden_layers": 8, "num_attention_heads": 32, "num_kv_heads": 8, "new_decoder_architecture": True,
           "bos_token_id": 11, "eos_token_id": 11}  # fmt: skip
    small, what = small_instance(load_any_config(raw))
    model = build_any_model(small)
    assert (model.config.num_attention_heads, model.config.num_kv_heads) == (4, 1)
    assert what == "3 blocks deep, vocab_size 512, hidden_size 64, num_attention_heads 4, num_kv_heads 1"


_UNET = {
    "_class_name": "UNet2DConditionModel",
    "sample_size": 8,
    "layers_per_block": 1,
    "block_out_channels": [32, 64],
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
    "cross_attention_dim": 32,
    "norm_num_groups": 8,
    "attention_head_dim": 4,
}
UNET_CONDITIONING = {
    # SDXL: pooled text embedding and size/crop ids beside the text encoder's states
    "sdxl": {
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 8,
        "projection_class_embeddings_input_dim": 80,
    },
    # DeepFloyd IF: the text encoder's states projected from their own width
    "projected-text": {"encoder_hid_dim": 48},
    "class-projection": {"class_embed_type": "projection", "projection_class_embeddings_input_dim": 12},
    "class-timestep": {"class_embed_type": "timestep"},
}


_TRANSFORMERS = {
    # Flux: latents as a sequence of packed patches, position ids for them and the text, a guidance scale
    "flux": {
        "_class_name": "FluxTransformer2DModel",
        "in_channels": 16,
        "num_layers": 1,
        "num_single_layers": 1,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 32,
        "pooled_projection_dim": 16,
        "axes_dims_rope": [4, 6, 6],
        "guidance_embeds": True,
    },
    # PixArt: the T5 states at caption_channels, projected to the blocks' cross_attention_dim
    "pixart": {
        "_class_name": "PixArtTransformer2DModel",
        "sample_size": 8,
        "num_layers": 1,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "in_channels": 4,
        "out_channels": 8,
        "cross_attention_dim": 32,
        "caption_channels": 24,
        "norm_num_groups": 8,
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_TRANSFORMERS))
def test_a_diffusion_transformer_s_own_inputs_are_synthesized_and_its_trace_is_the_allocator_s(name):
    """Flux's packed latents and ids, PixArt's caption width: the warm-up step raised on both before. Flux's peak
    sits inside SDPA's CPU flash backward, whose buffers are probed."""
    pytest.importorskip("diffusers")
    from trainledger.measure import measure
    from trainledger.trace import trace
    from trainledger.vision import workload_from_diffusers_config

    setup = Setup(micro_batch=1, seq_len=8, recipe="fp32")
    m = measure(workload_from_diffusers_config(_TRANSFORMERS[name], setup, latent_size=8), num_steps=1)
    assert 0 <= m.peak_bytes - m.traced.peak().bytes <= 16, (m.peak_bytes, m.traced.peak().bytes)
    fake = trace(workload_from_diffusers_config(_TRANSFORMERS[name], setup, latent_size=8, fake=True), fake=True)
    assert fake.peak().bytes == m.traced.peak().bytes


def test_an_autoencoder_is_no_denoiser_and_is_refused_in_one_line(capsys, tmp_path):
    pytest.importorskip("diffusers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"_class_name": "AutoencoderKL", "block_out_channels": [32], "norm_num_groups": 8}))
    code = main(["trace", "--diffusers-config", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no denoiser" in err, err


@pytest.mark.slow
@pytest.mark.parametrize("conditioning", list(UNET_CONDITIONING))
def test_a_unet_conditioned_beyond_text_is_traced_and_its_fake_trace_equals_the_real_one(conditioning):
    """The conditioning a UNet takes besides the text encoder's states (SDXL's ``added_cond_kwargs``, class labels
    of each embedding kind, a projected encoder width) is sized from its config; the warm-up step raised before."""
    pytest.importorskip("diffusers")
    from trainledger.trace import trace
    from trainledger.vision import workload_from_diffusers_config

    config = {**_UNET, **UNET_CONDITIONING[conditioning]}
    setup = Setup(micro_batch=2, seq_len=4, recipe="fp32")
    workload = workload_from_diffusers_config(config, setup)
    if conditioning == "sdxl":
        added = workload.batch["added_cond_kwargs"]
        assert added["text_embeds"].shape == (2, 80 - 6 * 8) and added["time_ids"].shape == (2, 6)
    real = trace(workload)
    fake = trace(workload_from_diffusers_config(config, setup, fake=True), fake=True)
    assert fake.peak().bytes == real.peak().bytes > 0


def test_a_unet_conditioned_on_image_embeddings_is_refused_in_one_line(capsys, tmp_path):
    pytest.importorskip("diffusers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_UNET, "encoder_hid_dim": 48, "encoder_hid_dim_type": "image_proj"}))
    code = main(["trace", "--diffusers-config", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "image embeddings" in err, err


def test_a_config_without_a_vocabulary_is_refused_in_one_line(capsys, tmp_path):
    """CANINE reads Unicode code points (no ``vocab_size``): a traceback before."""
    import transformers

    config = transformers.CanineConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )
    config.architectures = ["CanineForSequenceClassification"]
    path = tmp_path / "config.json"
    config.to_json_file(path)
    code = main(["trace", "--hf-config", str(path), "--fake"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no vocab_size" in err, err


def test_a_depth_no_one_key_sets_is_traced_whole(tmp_path):
    """Funnel's depth is the sum of its ``block_sizes``, and setting ``num_hidden_layers`` raises: the stacked
    trace rebuilt it 3 and 4 blocks deep and failed with a traceback. It has no one stack to extend: traced whole."""
    import transformers

    from trainledger.anymodel import depth_of
    from trainledger.trace import trace

    config = transformers.FunnelConfig(vocab_size=128, block_sizes=[2, 2], d_model=32, n_head=2, d_head=16, d_inner=64)
    config.architectures = ["FunnelForMaskedLM"]
    path = tmp_path / "config.json"
    config.to_json_file(path)
    cfg = load_any_config(path)
    assert depth_of(cfg) is None
    setup = Setup(micro_batch=2, seq_len=16, recipe="fp32")
    real = trace(workload_from_any_config(cfg, setup))
    assert trace(workload_from_any_config(cfg, setup, fake=True), fake=True).peak().bytes == real.peak().bytes


def test_a_small_bigbird_keeps_its_block_sparse_attention():
    """BigBird runs full attention, with modules of its own, on sequences of at most (5 + 2 x random blocks) x
    block_size tokens: the small instance a plan is verified on (32 tokens) switched, and every verification said
    the plan was made for another structure. Its blocks are made small enough to stay sparse."""
    from trainledger.anymodel import small_instance

    cfg = load_any_config(
        {
            "model_type": "big_bird",
            "architectures": ["BigBirdForMaskedLM"],
            "attention_type": "block_sparse",
            "block_size": 64,
            "num_random_blocks": 3,
            "hidden_size": 768,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "intermediate_size": 3072,
        }
    )
    small, _ = small_instance(cfg)
    threshold = (5 + 2 * small.raw["num_random_blocks"]) * small.raw["block_size"]
    assert small.raw["attention_type"] == "block_sparse" and threshold < 32 and 32 % small.raw["block_size"] == 0


def test_an_architecture_without_sdpa_says_it_is_built_with_eager_attention(cli, tmp_path):
    """Bloom has no SDPA path in transformers, so it is built with its eager attention, which saves every
    layer's attention probabilities: the trace says so instead of answering for another model than asked."""
    tiny = dict(vocab_size=64, hidden_size=32, num_attention_heads=4)
    configs = {
        "bloom": {"model_type": "bloom", "architectures": ["BloomForCausalLM"], "n_layer": 2, **tiny},
        "llama": {
            **{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, **tiny},
            "intermediate_size": 64,
            "hidden_act": "tanh",  # outside the analytic family's closed form: built whole, as Bloom is
        },
    }
    said = {}
    for name, cfg in configs.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg))
        code, _, err = cli("trace", "--hf-config", str(path), "--seq-len", "8", "--micro-batch", "1", "--fake")
        assert code == 0, err
        said[name] = [line for line in err.splitlines() if "attention in transformers" in line]
    assert said["bloom"] == [
        "note: BloomForCausalLM has no sdpa attention in transformers: it is built with eager and saves each "
        "layer's attention probabilities (micro-batch × heads × seq²)"
    ]
    assert said["llama"] == []


def test_a_diffusers_config_with_a_size_torch_refuses_is_one_line(cli, tmp_path):
    pytest.importorskip("diffusers")
    cfg = json.loads((FIXTURES / "sd15-unet-tiny-diffusers.json").read_text())
    cfg["block_out_channels"] = [cfg["block_out_channels"][0], -cfg["block_out_channels"][-1]]
    path = tmp_path / "unet.json"
    path.write_text(json.dumps(cfg))
    for fake in ((), ("--fake",)):
        code, _, err = cli("trace", "--diffusers-config", str(path), "--micro-batch", "1", *fake)
        assert code == 2 and "diffusers cannot build UNet2DConditionModel" in err and "negative dimension" in err
        assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    ("sample_size", "said"),
    [(-4, "must be at least 1"), ("64", "is a str"), (1e9, "is a float"), (0, "must be at least 1")],
)
def test_a_diffusers_config_with_a_bad_sample_size_is_one_line(cli, tmp_path, sample_size, said):
    """The latent side came from the config unchecked: a traceback from the batch's tensors (exit 1), or 0 taken."""
    pytest.importorskip("diffusers")
    cfg = json.loads((FIXTURES / "sd15-unet-tiny-diffusers.json").read_text())
    cfg["sample_size"] = sample_size
    path = tmp_path / "unet.json"
    path.write_text(json.dumps(cfg))
    code, _, err = cli("trace", "--diffusers-config", str(path), "--fake")
    assert code == 2 and f"sample_size in {path}" in err and said in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_a_diffusers_config_that_leaves_its_channels_to_the_models_defaults_is_traced(cli, tmp_path):
    """A UNet2DModel config without ``in_channels`` has the class's 3: the batch drew 4 (a latent's) and the step
    failed on the first convolution."""
    pytest.importorskip("diffusers")
    unconditioned = {"down_block_types": ["DownBlock2D"] * 2, "up_block_types": ["UpBlock2D"] * 2}
    cfg = {**{k: v for k, v in _UNET.items() if "attention" not in k}, **unconditioned, "_class_name": "UNet2DModel"}
    path = tmp_path / "unet.json"
    path.write_text(json.dumps(cfg))
    code, out, err = cli("trace", "--diffusers-config", str(path), "--fake", "--json")
    assert code == 0, err
    assert json.loads(out)["peak"]["bytes"] > 0


def test_an_activation_transformers_has_no_entry_for_is_named_in_one_line(cli, tmp_path):
    """transformers looks the activation up in a table: its KeyError was printed as a bare ``'evil'``."""
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 2,
        "vocab_size": 64,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "hidden_act": "evil",
    }
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(cfg))
    code, _, err = cli("trace", "--hf-config", str(path), "--seq-len", "8", "--fake")
    assert code == 2 and "'evil' is a name transformers has no entry for" in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"num_hidden_layers": 0}, "num_hidden_layers in the config 0 must be at least 1"),
        ({"num_attention_heads": "2"}, "num_attention_heads in the config '2' is a str"),
        ({"architectures": "BertForMaskedLM"}, "architectures in the config is 'BertForMaskedLM'; give a list"),
        ({"torch_dtype": "float128"}, "torch_dtype 'float128' in the config is no dtype torch has"),
    ],
)
def test_a_config_value_no_model_can_have_is_one_line(cli, tmp_path, change, said):
    """Outside the analytic families these were taken as given: 0 layers traced a model of none, and a string
    ``architectures`` was ignored, the model then trained as a causal LM instead of the masked LM it named."""
    cfg = {**json.loads((FIXTURES / "bert-tiny.json").read_text()), **change}
    path = tmp_path / "bert.json"
    path.write_text(json.dumps(cfg))
    code, _, err = cli("trace", "--hf-config", str(path), "--fake")
    assert code == 2 and said in err, err
    assert len(err.strip().splitlines()) == 1


def test_parameters_made_in_fp32_by_hand_are_built_in_the_recipes_dtype():
    """XLNet makes its relative attention's weights as ``nn.Parameter(torch.FloatTensor(...))``, which the dtype
    transformers builds in does not reach: they stayed fp32 beside bf16 ones and the warm-up step failed."""
    from trainledger.trace import trace

    cfg = {"model_type": "xlnet", "architectures": ["XLNetLMHeadModel"], "vocab_size": 128, "d_model": 32}
    cfg |= {"n_layer": 2, "n_head": 2, "d_inner": 64}
    w = workload_from_any_config(load_any_config(cfg), Setup(micro_batch=2, seq_len=16, recipe="bf16-master"))
    assert {p.dtype for p in w.model.parameters()} == {torch.bfloat16}
    ledger = trace(w)
    assert ledger.num_params() == sum(p.numel() for p in w.model.parameters())


def test_an_image_size_takes_the_form_the_config_keeps_it_in():
    """Hiera keeps its image size as ``[h, w]`` and refuses an int."""
    cfg = {"model_type": "hiera", "architectures": ["HieraForImageClassification"], "image_size": [64, 64]}
    cfg |= {"embed_dim": 16, "depths": [1, 1, 1, 1], "num_heads": [1, 1, 2, 2], "num_labels": 3}
    w = workload_from_any_config(load_any_config(cfg), Setup(micro_batch=2, seq_len=16), image_size=32, fake=True)
    assert tuple(w.batch["pixel_values"].shape) == (2, 3, 32, 32)
