"""Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``): traced as their index and
value storages, with the plain step's sharing (a dispatch mode makes ``AccumulateGrad`` copy them)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainledger.errors import InputError
from trainledger.ledger import Category
from trainledger.measure import measure
from trainledger.trace import trace
from trainledger.workload import Workload, run_step

# Adagrad's own sparse path builds a sparse tensor without saying whether to check it, which torch warns of
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")


class _Twice(nn.Module):
    """One sparse table read twice: backward sums two sparse gradients before accumulating them."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(100, 8, sparse=True)
        self.bag = nn.EmbeddingBag(60, 8, mode="mean", sparse=True)

    def forward(self, a: torch.Tensor, b: torch.Tensor, bags: torch.Tensor) -> torch.Tensor:
        return (self.table(a) * self.table(b)).sum(-1).mean() + self.bag(bags).square().mean()


def _one_table(optimizer: str) -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 8, sparse=True))
    factories = {
        "sparse-adam": lambda p: torch.optim.SparseAdam(list(p)),
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
        "adagrad": lambda p: torch.optim.Adagrad(p),
    }
    return Workload(
        model, torch.randint(0, 100, (4, 5)), loss_fn=lambda out, _: out.square().mean(), optimizer=factories[optimizer]
    )


def _twice() -> Workload:
    torch.manual_seed(0)
    batch = (torch.randint(0, 100, (6,)), torch.randint(0, 100, (6,)), torch.randint(0, 60, (6, 3)))
    return Workload(_Twice(), batch, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))


STEPS = {"sparse-adam": lambda: _one_table("sparse-adam"), "sgd": lambda: _one_table("sgd"),
         "adagrad": lambda: _one_table("adagrad"), "read-twice": _twice}  # fmt: skip


@pytest.mark.parametrize("name", sorted(STEPS))
def test_a_sparse_gradients_step_is_traced_to_the_allocators_count(name):
    m = measure(STEPS[name](), num_steps=1)
    # what the trace cannot see is the optimizers' scalar temporaries made inside a kernel (4 and 8 bytes)
    assert 0 <= m.peak_bytes - m.traced.peak().bytes <= 16
    grads = [e for e in m.traced.entries if e.category is Category.GRADIENTS]
    assert grads and all(e.name.endswith(".weight.grad") for e in grads)


def test_a_sparse_gradient_shares_its_indices_with_the_batch_as_in_a_plain_step():
    """Without the tracer's substitute the traced step copies the gradient, 160 bytes of indices more at the
    peak than the plain step holds."""
    led = trace(_one_table("sparse-adam"))
    grads = [e for e in led.entries if e.category is Category.GRADIENTS]
    assert [(e.dtype, e.nbytes) for e in grads] == [("float32", 4 * 5 * 8 * 4)]  # the values; the indices: batch[0]
    assert all(led.events[e.alloc_event].phase == "backward" and led.events[e.alloc_event].op != "aten.clone"
               for e in grads)  # fmt: skip


@pytest.mark.parametrize("name", sorted(STEPS))
def test_tracing_a_sparse_step_leaves_training_as_a_plain_step_would(name):
    traced, plain = STEPS[name](), STEPS[name]()
    trace(traced)
    for w in (traced, plain):
        torch.manual_seed(1)
        run_step(w)
    dense = lambda t: t.to_dense() if t.layout is not torch.strided else t  # noqa: E731
    state = lambda w: [dense(v) for s in w.get_optimizer().state.values() for v in s.values() if torch.is_tensor(v)]  # noqa: E731
    pairs = [*zip(traced.model.state_dict().values(), plain.model.state_dict().values(), strict=True),
             *zip(state(traced), state(plain), strict=True)]  # fmt: skip
    assert pairs and all(torch.equal(a, b) for a, b in pairs)


def test_a_recorded_loop_with_sparse_gradients_peaks_as_the_trace_of_its_step():
    from trainledger.record import record

    traced = trace(_one_table("sparse-adam")).peak().bytes
    w = _one_table("sparse-adam")
    optimizer = w.get_optimizer()
    with record(w.model, optimizer, steps=1) as rec:
        for _ in range(3):
            run_step(w)
    assert rec.peak().bytes == traced


@pytest.mark.parametrize("kind", ["fake", "cuda"])
def test_sparse_gradients_on_fake_tensors_are_refused_in_one_line(kind):
    """How many rows a sparse gradient holds is how many distinct ones the batch reads: a value."""
    options = {"fake": True} if kind == "fake" else {"kernel_kind": "cuda"}
    with pytest.raises(InputError, match=r"gradients are sparse .* fake tensors do not know") as refused:
        trace(_one_table("sgd"), **options)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("run", [False, True], ids=["predicted", "run"])
def test_sharding_sparse_gradients_is_refused_in_one_line(cli, tmp_path, run):
    """The prediction models dense gradients (on a model with two sparse tables it said 452,052 bytes a rank
    where DDP's ranks held 260,052), and FSDP's own collectives have no sparse kernel."""
    factory = tmp_path / "sparse_step.py"
    factory.write_text(
        "import torch\nfrom torch import nn\nimport trainledger\n\n"
        "def build():\n"
        "    model = nn.Sequential(nn.Embedding(100, 8, sparse=True))\n"
        "    return trainledger.Workload(model, torch.randint(0, 100, (4, 5)), loss_fn=lambda o, b: o.square().mean(),"
        " optimizer=lambda p: torch.optim.SGD(p, lr=0.1))\n"
    )
    code, out, err = cli("shard", "--model", f"{factory}:build", "--stage", "1", "--world", "2", *(["--run"] * run))
    assert code == 2 and not out
    assert "sparse gradients" in err and len(err.strip().splitlines()) == 1
