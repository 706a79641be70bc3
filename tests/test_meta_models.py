"""Models built on the meta device (no values) trace on fake tensors as the device named: the oracle is the same
model built for real, whose fake trace must be the same ledger entry for entry and whose real trace the same peak."""

from __future__ import annotations

import contextlib
import json
import sys
import textwrap

import pytest
import torch
from torch import nn

from trainledger.cli import main
from trainledger.errors import InputError
from trainledger.trace import EmptyWeights, trace
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


class DropPathLM(TinyLM):
    """TinyLM whose constructor reads a tensor's value, as timm's ViT builds its drop-path schedule."""

    def __init__(self, drop_path_rate: float = 0.1) -> None:
        super().__init__()
        rates = [x.item() for x in torch.linspace(0, drop_path_rate, len(self.blocks))]  # data-dependent
        self.register_buffer("positions", torch.arange(SEQ_LEN))  # small: stays real, read in forward
        self.rates = rates
        nn.init.trunc_normal_(self.embed.weight, std=rates[-1])  # an initialiser: on meta in the empty build

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.embed.weight[self.positions[: ids.shape[1]]]
        logits = self.head(self.blocks(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def build_drop_path(empty: bool = False) -> Workload:
    torch.manual_seed(0)
    with EmptyWeights() if empty else contextlib.nullcontext():
        model = DropPathLM()
    ids = torch.randint(0, VOCAB, (2, SEQ_LEN))
    return Workload(model, ids, loss_fn=lambda loss, _: loss, name="drop-path-lm")


def test_a_model_that_reads_values_while_built_cannot_be_built_on_fake_tensors_or_meta():
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    with pytest.raises(DataDependentOutputException), FakeTensorMode():
        DropPathLM()
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"), torch.device("meta"):
        DropPathLM()


@pytest.mark.slow
def test_a_model_built_with_empty_weights_traces_as_the_real_built_one():
    w = build_drop_path(empty=True)
    assert all(p.is_meta for p in w.model.parameters()) and not w.model.positions.is_meta
    assert w.model.rates == pytest.approx([0.0, 0.1])  # computed for real
    empty, fake, real = trace(w, fake=True), trace(build_drop_path(), fake=True), trace(build_drop_path())
    assert ("buffer", SEQ_LEN * 8) in {(e.role, e.nbytes) for e in empty.entries}  # the real buffer, converted
    assert _entries(empty) == _entries(fake) == _entries(real) and len(empty.entries) > 20
    assert [(e.index, e.phase, e.op, e.module) for e in empty.events] == [
        (e.index, e.phase, e.op, e.module) for e in real.events
    ]
    assert empty.peak().bytes == real.peak().bytes and empty.peak().event == real.peak().event


def test_empty_weights_moves_parameters_and_large_buffers_only_while_entered():
    with EmptyWeights(small_buffer_bytes=64) as empty:
        big = nn.Linear(4096, 4096)  # 64 MiB were it real: created with torch.empty, moved as registered
        big.register_buffer("small", torch.zeros(16))  # 64 bytes: real
        big.register_buffer("large", torch.zeros(17))  # 68 bytes: meta
        with empty:  # re-entered, nested
            inner = nn.Linear(2, 2)
        after_nested = nn.Linear(2, 2)
        tied = nn.Module()
        tied.weight = big.weight
    assert big.weight.is_meta and big.bias.is_meta and big.weight.requires_grad
    assert isinstance(big.weight, nn.Parameter) and tied.weight is big.weight
    assert not big.small.is_meta and big.large.is_meta
    assert inner.weight.is_meta and after_nested.weight.is_meta
    assert not nn.Linear(2, 2).weight.is_meta  # the hooks are gone


@pytest.mark.slow
def test_trace_fake_of_a_factory_builds_its_model_with_empty_weights(tmp_path, capsys):
    src = tmp_path / "drop_path_model.py"
    src.write_text(
        "import torch\nfrom tests.test_meta_models import build_drop_path\n\n"
        "SEEN = []\n\ndef factory():\n    w = build_drop_path()\n"
        "    SEEN.append(next(w.model.parameters()).device.type)\n    return w\n"
    )
    assert main(["trace", "--model", f"{src}:factory", "--fake", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    real = trace(build_drop_path())
    assert out["peak"]["bytes"] == real.peak().bytes and out["peak"]["event"] == real.peak().event
    seen = [m for name, m in sys.modules.items() if name.startswith("_trainledger_user_") and hasattr(m, "SEEN")]
    assert [m.SEEN for m in seen] == [["meta"]]  # built plainly by the factory, its weights on meta
