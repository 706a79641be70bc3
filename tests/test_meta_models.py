"""Models built on the meta device (no values) trace on fake tensors as the device named: the oracle is the same
model built for real, whose fake trace must be the same ledger entry for entry and whose real trace the same peak."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch import nn

from trainledger.cli import main
from trainledger.errors import InputError
from trainledger.trace import trace
from trainledger.workload import Workload

SEQ_LEN, WIDTH, VOCAB = 8, 16, 32


class CausalBlock(nn.Module):
    """One attention-like mixing step whose causal mask is made in ``forward`` on the default device."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(WIDTH, 2 * WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.register_buffer("scale", torch.full((), WIDTH**-0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, dim=-1)  # (B, T, C) each
        mask = torch.ones(x.shape[1], x.shape[1]).tril().bool()  # (T, T), default device
        scores = (q @ k.transpose(1, 2) * self.scale).masked_fill(~mask, float("-inf"))
        return self.norm(x + scores.softmax(-1) @ x)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(CausalBlock(), CausalBlock())
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied, as language models often are

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.blocks(self.embed(ids)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def build(device: str = "cpu") -> Workload:
    torch.manual_seed(0)
    with torch.device(device):
        model = TinyLM()
    ids = torch.randint(0, VOCAB, (2, SEQ_LEN))
    return Workload(model, ids, loss_fn=lambda loss, _: loss, name="tiny-lm")


def _entries(led):
    return [
        (e.name, e.category, e.role, e.dtype, e.shape, e.nbytes, e.device, e.alloc_event, e.free_event)
        for e in led.entries
    ]


@pytest.mark.slow
def test_a_meta_built_model_traces_as_the_real_built_one():
    meta = trace(build("meta"), fake=True)
    fake = trace(build(), fake=True)
    real = trace(build())
    assert next(build("meta").model.parameters()).is_meta  # the oracle is not a model built for real
    assert _entries(meta) == _entries(fake) and len(meta.entries) > 20
    assert [(e.index, e.phase, e.op, e.module) for e in meta.events] == [
        (e.index, e.phase, e.op, e.module) for e in fake.events
    ]
    assert meta.device == "cpu"
    assert meta.peak().bytes == real.peak().bytes and meta.peak().event == real.peak().event


def test_a_meta_built_model_keeps_its_meta_weights_and_is_refused_for_a_real_trace():
    w = build("meta")
    trace(w, fake=True)
    assert all(p.is_meta for p in w.model.parameters())
    with pytest.raises(InputError, match=r"meta device.*--fake"):
        trace(w)
    with pytest.raises(InputError, match="device"):
        trace(w, fake=True, device="nowhere")


@pytest.mark.slow
def test_trace_fake_of_a_meta_factory_on_the_command_line(tmp_path, capsys):
    src = tmp_path / "meta_model.py"
    src.write_text(
        textwrap.dedent(
            """
            import torch
            from tests.test_meta_models import build

            def factory():
                return build("meta")
            """
        )
    )
    assert main(["trace", "--model", f"{src}:factory", "--fake", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["peak"]["bytes"] == trace(build()).peak().bytes
    assert main(["trace", "--model", f"{src}:factory"]) == 2
    assert "meta device" in capsys.readouterr().err


@pytest.mark.slow
def test_meta_device_on_the_command_line(tmp_path, capsys):
    src = tmp_path / "meta_model.py"
    src.write_text("from tests.test_meta_models import build\n\ndef factory():\n    return build('meta')\n")
    model = f"{src}:factory"
    assert main(["trace", "--model", model, "--fake", "--meta-device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "cpu" and out["peak"]["bytes"] == trace(build("meta"), fake=True).peak().bytes
    for argv, says in [
        (["--fake", "--meta-device", "nowhere"], "'nowhere' is no device PyTorch knows"),
        (["--meta-device", "cpu"], "add --fake"),
        *([] if torch.backends.cuda.is_built() else [(["--fake", "--meta-device", "cuda"], "cannot trace as")]),
    ]:
        assert _status(["trace", "--model", model, *argv]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
    assert _status(["trace", "--hf-config", "tests/fixtures/hf/t5-base.json", "--fake", "--meta-device", "cpu"]) == 2
    assert "applies to a model built on the meta device" in capsys.readouterr().err


def _status(argv: list[str]) -> int:
    """The exit status of the command (argparse's errors exit instead of returning)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code
