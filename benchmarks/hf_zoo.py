"""Architectures we never tried, as a new user would try them: a tiny config of each, traced fake and real.

For every row a tiny config is built locally from ``transformers``' own config class
(``AutoConfig.for_model(model_type, hidden_size=64, num_hidden_layers=2, ...)``, nothing downloaded), saved as
``config.json`` with ``architectures`` set, and three commands run, each in a fresh process with a timeout:

- ``trainledger trace --hf-config config.json --fake --json`` (fake tensors),
- ``trainledger trace --hf-config config.json --json`` (the same step on real tensors),
- ``trainledger estimate --hf-config config.json --device-kind cpu --json`` (a number for the analytic families,
  with the kernels traced here; for the others one line saying that only the trace covers them).

The fake and the real traced peaks are expected to be equal to the byte. Every step is micro-batch 2, fp32,
AdamW; sequences are 32 long (tokens, or audio frames). A command that fails prints its last line of stderr
into the table, and its exit status (2: refused in one line, as a user error; anything else: a crash).

Run from the repository root (a few minutes on a small machine):

    python -m benchmarks.hf_zoo                      # every row
    python -m benchmarks.hf_zoo --only bart whisper  # some rows

It prints each row as it ends, keeps the results in ``benchmarks/results/hf_zoo.json`` (``--only`` re-runs some
rows and keeps the others') and writes the Markdown table to ``benchmarks/results/hf_zoo.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"

_TEXT = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 128,
}
_SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
"""Special tokens inside the tiny vocabulary (some modules refuse a padding index outside it)."""
_DECODER = {**_TEXT, "num_key_value_heads": 2}
_SEQ2SEQ = {
    "vocab_size": 256,
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "max_position_embeddings": 128,
}
_T5 = {"vocab_size": 256, "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4}
_VIT = {
    "image_size": 32,
    "patch_size": 8,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "num_labels": 10,
}
_SMALL = {"image_size": 32, "depths": [1, 1], "num_labels": 10}
_CONV = {"embedding_size": 16, "hidden_sizes": [16, 32]}
_WAV2VEC2 = {
    "vocab_size": 32,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "conv_dim": (32, 32, 32),
    "conv_stride": (5, 4, 4),
    "conv_kernel": (10, 8, 8),
    "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 4,
}


@dataclass(frozen=True, kw_only=True)
class Arch:
    """One architecture: its config class's ``model_type``, the class trained, and tiny sizes."""

    name: str
    """The row's label."""
    model_type: str
    """transformers' name of the config class (``AutoConfig.for_model``)."""
    architecture: str
    """The model class named in ``architectures``."""
    sizes: dict[str, Any] = field(default_factory=dict)
    """The config's keywords: everything that makes it tiny."""
    task: str | None = None
    """``--task`` (default: none, the task follows ``architectures``)."""
    sequence: bool = True
    """Whether the step reads a sequence (``--seq-len 32``: tokens, or audio frames) rather than only images."""


def _vision(name: str, model_type: str, architecture: str, **sizes: Any) -> Arch:
    return Arch(name=name, model_type=model_type, architecture=architecture, sizes=sizes, sequence=False)


ROWS: tuple[Arch, ...] = (
    # decoder LMs
    Arch(name="gemma", model_type="gemma", architecture="GemmaForCausalLM", sizes={**_DECODER, "head_dim": 16}),
    Arch(name="gemma2", model_type="gemma2", architecture="Gemma2ForCausalLM", sizes={**_DECODER, "head_dim": 16}),
    Arch(
        name="gemma3-text",
        model_type="gemma3_text",
        architecture="Gemma3ForCausalLM",
        sizes={**_DECODER, "head_dim": 16, "sliding_window": 16},
    ),
    Arch(name="falcon", model_type="falcon", architecture="FalconForCausalLM", sizes=dict(_TEXT)),
    Arch(
        name="opt",
        model_type="opt",
        architecture="OPTForCausalLM",
        sizes={**_TEXT, "ffn_dim": 128, "word_embed_proj_dim": 64},
    ),
    Arch(
        name="bloom",
        model_type="bloom",
        architecture="BloomForCausalLM",
        sizes={"vocab_size": 256, "hidden_size": 64, "n_layer": 2, "n_head": 4},
    ),
    Arch(
        name="gpt-j",
        model_type="gptj",
        architecture="GPTJForCausalLM",
        sizes={"vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8, "n_positions": 128},
    ),
    Arch(
        name="gpt-neo",
        model_type="gpt_neo",
        architecture="GPTNeoForCausalLM",
        sizes={
            "vocab_size": 256,
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "attention_types": [[["global", "local"], 1]],
            "max_position_embeddings": 128,
            "window_size": 16,
        },
    ),
    Arch(name="stablelm", model_type="stablelm", architecture="StableLmForCausalLM", sizes=dict(_DECODER)),
    Arch(name="starcoder2", model_type="starcoder2", architecture="Starcoder2ForCausalLM", sizes=dict(_DECODER)),
    Arch(
        name="qwen2-moe",
        model_type="qwen2_moe",
        architecture="Qwen2MoeForCausalLM",
        sizes={
            **_DECODER,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    Arch(name="qwen3", model_type="qwen3", architecture="Qwen3ForCausalLM", sizes={**_DECODER, "head_dim": 16}),
    Arch(name="olmo", model_type="olmo", architecture="OlmoForCausalLM", sizes=dict(_DECODER)),
    Arch(name="cohere", model_type="cohere", architecture="CohereForCausalLM", sizes=dict(_DECODER)),
    Arch(name="phi3", model_type="phi3", architecture="Phi3ForCausalLM", sizes={**_DECODER, **_SPECIAL}),
    Arch(
        name="mpt",
        model_type="mpt",
        architecture="MptForCausalLM",
        sizes={"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 128},
    ),
    Arch(
        name="mamba",
        model_type="mamba",
        architecture="MambaForCausalLM",
        sizes={"vocab_size": 256, "hidden_size": 64, "state_size": 8, "num_hidden_layers": 2},
    ),
    Arch(name="llama", model_type="llama", architecture="LlamaForCausalLM", sizes=dict(_DECODER)),
    # encoders
    Arch(name="deberta-v2", model_type="deberta-v2", architecture="DebertaV2ForMaskedLM", sizes=dict(_TEXT)),
    Arch(
        name="albert",
        model_type="albert",
        architecture="AlbertForMaskedLM",
        sizes={**_TEXT, "embedding_size": 32},
    ),
    Arch(
        name="electra", model_type="electra", architecture="ElectraForMaskedLM", sizes={**_TEXT, "embedding_size": 32}
    ),
    Arch(
        name="distilbert",
        model_type="distilbert",
        architecture="DistilBertForMaskedLM",
        sizes={
            "vocab_size": 256,
            "dim": 64,
            "n_layers": 2,
            "n_heads": 4,
            "hidden_dim": 128,
            "max_position_embeddings": 128,
        },
    ),
    Arch(name="xlm-roberta", model_type="xlm-roberta", architecture="XLMRobertaForMaskedLM", sizes=dict(_TEXT)),
    Arch(
        name="modernbert",
        model_type="modernbert",
        architecture="ModernBertForMaskedLM",
        sizes={
            **_TEXT,
            **_SPECIAL,
            "cls_token_id": 1,
            "sep_token_id": 2,
            "global_attn_every_n_layers": 2,
            "local_attention": 16,
        },
    ),
    # encoder-decoders
    Arch(name="bart", model_type="bart", architecture="BartForConditionalGeneration", sizes=dict(_SEQ2SEQ)),
    Arch(name="mbart", model_type="mbart", architecture="MBartForConditionalGeneration", sizes=dict(_SEQ2SEQ)),
    Arch(name="pegasus", model_type="pegasus", architecture="PegasusForConditionalGeneration", sizes=dict(_SEQ2SEQ)),
    Arch(
        name="marian",
        model_type="marian",
        architecture="MarianMTModel",
        sizes={**_SEQ2SEQ, "decoder_vocab_size": 256, "pad_token_id": 0, "decoder_start_token_id": 0},
    ),
    Arch(
        name="t5-gated",
        model_type="t5",
        architecture="T5ForConditionalGeneration",
        sizes={**_T5, "feed_forward_proj": "gated-gelu"},
    ),
    Arch(
        name="umt5",
        model_type="umt5",
        architecture="UMT5ForConditionalGeneration",
        sizes={**_T5, "feed_forward_proj": "gated-gelu"},
    ),
    # vision
    _vision("deit", "deit", "DeiTForImageClassification", **_VIT),
    _vision("beit", "beit", "BeitForImageClassification", **_VIT),
    _vision(
        "swin",
        "swin",
        "SwinForImageClassification",
        **_SMALL,
        patch_size=4,
        embed_dim=16,
        num_heads=[2, 2],
        window_size=4,
    ),
    _vision(
        "convnextv2", "convnextv2", "ConvNextV2ForImageClassification", **_SMALL, hidden_sizes=[16, 32], num_stages=2
    ),
    _vision("resnet", "resnet", "ResNetForImageClassification", **_SMALL, **_CONV),
    _vision("regnet", "regnet", "RegNetForImageClassification", **_SMALL, **_CONV, groups_width=8),
    _vision(
        "mobilevit",
        "mobilevit",
        "MobileViTForImageClassification",
        image_size=64,
        hidden_sizes=[32, 48, 64],
        neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
        num_labels=10,
    ),
    _vision("dinov2", "dinov2", "Dinov2ForImageClassification", **_VIT),
    _vision(
        "segformer",
        "segformer",
        "SegformerForSemanticSegmentation",
        image_size=32,
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[16, 32],
        patch_sizes=[7, 3],
        strides=[4, 2],
        num_attention_heads=[1, 2],
        mlp_ratios=[2, 2],
        decoder_hidden_size=32,
        num_labels=5,
    ),
    # audio
    Arch(
        name="whisper",
        model_type="whisper",
        architecture="WhisperForConditionalGeneration",
        sizes={
            **{k: v for k, v in _SEQ2SEQ.items() if k != "max_position_embeddings"},
            **_SPECIAL,
            "num_mel_bins": 16,
            "max_source_positions": 32,
            "max_target_positions": 64,
            "decoder_start_token_id": 1,
            "suppress_tokens": [],
            "begin_suppress_tokens": [],
        },
    ),
    Arch(
        name="wav2vec2-ctc",
        model_type="wav2vec2",
        architecture="Wav2Vec2ForCTC",
        sizes=dict(_WAV2VEC2),
    ),
    Arch(name="hubert-ctc", model_type="hubert", architecture="HubertForCTC", sizes=dict(_WAV2VEC2)),
    # multimodal
    Arch(
        name="clip",
        model_type="clip",
        architecture="CLIPModel",
        sizes={
            "text_config": {**_TEXT, "max_position_embeddings": 64},
            "vision_config": {k: v for k, v in _VIT.items() if k != "num_labels"},
            "projection_dim": 32,
        },
    ),
    Arch(
        name="siglip",
        model_type="siglip",
        architecture="SiglipModel",
        sizes={
            "text_config": {**_TEXT, "max_position_embeddings": 64},
            "vision_config": {k: v for k, v in _VIT.items() if k != "num_labels"},
        },
    ),
    # heads of other tasks
    Arch(
        name="bart:sequence-classification",
        model_type="bart",
        architecture="BartForSequenceClassification",
        sizes=dict(_SEQ2SEQ),
    ),
    Arch(
        name="wav2vec2:audio-classification",
        model_type="wav2vec2",
        architecture="Wav2Vec2ForSequenceClassification",
        sizes={**_WAV2VEC2, "classifier_proj_size": 32},
    ),
    # one family, every text task
    *(
        Arch(name=f"bert:{task}", model_type="bert", architecture="BertModel", sizes=dict(_TEXT), task=task)
        for task in ("sequence-classification", "token-classification", "question-answering", "masked-lm", "causal-lm")
    ),
)
"""Tiny configs of architectures outside the benchmark of :mod:`benchmarks.architectures`."""


def write_config(arch: Arch, folder: Path) -> Path:
    """The tiny config, built by transformers' own config class and saved as ``config.json``."""
    import transformers

    config = transformers.AutoConfig.for_model(arch.model_type, **arch.sizes)
    config.architectures = [arch.architecture]
    path = folder / "config.json"
    config.to_json_file(path)
    return path


def _run(args: list[str], timeout_s: float | None) -> dict[str, Any]:
    """One command in a fresh process (``timeout_s`` None: in this one, without a timeout): its traced or
    estimated peak, or its exit status and last line of stderr."""
    cmd = [sys.executable, "-m", "trainledger.cli", *args, "--json"]
    if timeout_s is None:
        returncode, stdout, stderr = _in_process([*args, "--json"])
    else:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "line": f"over {timeout_s:.0f} s"}
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    if returncode:
        lines = stderr.strip().splitlines() or [f"exit {returncode}"]
        return {"status": returncode, "line": lines[-1], "traceback": "Traceback" in stderr}
    return {"status": 0, "peak": json.loads(stdout).get("peak", {}).get("bytes")}


def _in_process(args: list[str]) -> tuple[int, str, str]:
    """The command line's ``main`` called here: the imports paid once (minutes saved on a loaded machine)."""
    from trainledger.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(args)
        except SystemExit as exc:  # argparse's own errors
            status = exc.code if isinstance(exc.code, int) else 2
        except Exception:
            traceback.print_exc()
            status = 1
    return status, out.getvalue(), err.getvalue()


def run_row(arch: Arch, timeout_s: float | None) -> dict[str, Any]:
    """The three commands of one architecture."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_config(arch, Path(tmp)))
        step = ["--micro-batch", "2", "--dtype", "fp32", *(["--seq-len", "32"] if arch.sequence else [])]
        task = ["--task", arch.task] if arch.task else []
        trace = ["trace", "--hf-config", path, *step, *task]
        results = {
            "fake": _run([*trace, "--fake"], timeout_s),
            "real": _run(trace, timeout_s),
            "estimate": _run(["estimate", "--hf-config", path, *step, "--device-kind", "cpu"], timeout_s),
        }
    for result in results.values():  # the temporary folder means nothing once it is gone
        if "line" in result:
            result["line"] = result["line"].replace(path, "config.json").replace(tmp, "")[:200]
    return results


def _cell(result: dict[str, Any]) -> str:
    if result["status"] == 0:
        return f"{result['peak']:,}"
    kind = "crash" if result.get("traceback") or result["status"] not in (2, "timeout") else "refused"
    return f"{kind} ({result['status']}): {result['line'].replace('|', '/')}"


def _estimate_cell(result: dict[str, Any]) -> str:
    if result["status"] == 0:
        return f"{result['peak']:,}" if isinstance(result["peak"], int) else "ok"
    if result["status"] == 2 and "only the trace covers it" in result["line"]:
        return "trace only"
    return _cell(result)


def line(arch: Arch, r: dict[str, Any]) -> str:
    """One table row: both peaks, whether they agree, the estimate."""
    fake, real = r["fake"], r["real"]
    both = fake["status"] == 0 and real["status"] == 0
    agree = ""
    if both:
        f, g = fake["peak"], real["peak"]
        agree = "yes" if f == g else f"no ({f - g:+,})"
    task = arch.task or "(architectures)"
    return (
        f"| {arch.name} | {arch.architecture} | {task} | {_cell(fake)} | {_cell(real)} | {agree} "
        f"| {_estimate_cell(r['estimate'])} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--only", nargs="+", metavar="NAME", help="rows to run (default: all); the others keep their results"
    )
    ap.add_argument("--timeout", type=float, default=300, help="seconds per command (default 300)")
    ap.add_argument("--jobs", type=int, default=1, help="rows run at once (default 1)")
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="run the commands in this process, one at a time, without a timeout (imports paid once)",
    )
    ap.add_argument("--out", default="hf_zoo.md")
    args = ap.parse_args()
    rows = [r for r in ROWS if not args.only or r.name in args.only]
    import torch
    import transformers

    saved = RESULTS / (Path(args.out).stem + ".json")
    results = json.loads(saved.read_text()) if args.only and saved.exists() else {}
    lock = threading.Lock()

    def run(arch: Arch) -> None:
        result = run_row(arch, None if args.in_process else args.timeout)
        with lock:  # each row kept as it ends: a long sweep can be resumed with --only
            results[arch.name] = result
            print(line(arch, result), flush=True)
            saved.write_text(json.dumps(results, indent=1) + "\n")

    RESULTS.mkdir(exist_ok=True)
    with ThreadPoolExecutor(1 if args.in_process else args.jobs) as pool:
        list(pool.map(run, rows))
    lines = [line(a, results[a.name]) for a in ROWS if a.name in results]
    agree = sum(" | yes | " in text for text in lines)
    head = [
        f"Tiny configs traced fake and real (transformers {transformers.__version__}, torch {torch.__version__}); "
        "micro-batch 2, fp32, AdamW, sequences of 32 (tokens, or audio frames); "
        f"`python -m benchmarks.hf_zoo{' --in-process' if args.in_process else ''}`.",
        "",
        "| row | architectures | --task | fake peak | real peak | fake = real | estimate |",
        "|---|---|---|---:|---:|---|---:|",
    ]
    tail = ["", f"{agree} of {len(lines)} rows traced fake and real to the same peak byte."]
    (RESULTS / args.out).write_text("\n".join(head + lines + tail) + "\n")


if __name__ == "__main__":
    main()
