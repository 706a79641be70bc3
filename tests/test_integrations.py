"""The Trainer and Lightning callbacks on real runs of tiny models built here (no downloads): each records
the chosen optimizer step, with its accumulated micro-batches, and writes a ledger and an HTML page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from trainledger import Category
from trainledger.report.saved import open_saved

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning"),
]


def check_written(ledger_path: Path, html_path: Path | None, *, micro_batches: int) -> None:
    assert ledger_path.name == "rank-0.json" and ledger_path.parent.name == "step-1"
    led = open_saved(ledger_path).result
    phases = {ev.phase for ev in led.events}
    assert {"forward", "backward", "optimizer"} <= phases
    assert len([c for c in led.calls if c.path == "(root)"]) == micro_batches
    assert led.select(category=Category.OPTIMIZER) and led.select(category=Category.GRADIENTS)
    assert led.peak().bytes > 0
    assert html_path is not None and html_path.stat().st_size > 1000
    # a folder of per-rank ledgers is what `trainledger report DIR` compares
    assert open_saved(ledger_path.parent).kind == "ranks"


def _quiet_trainer(pl: Any, root: Path, callback: Any, **schedule: int) -> Any:
    """A Lightning trainer on the CPU that writes nothing but what the callback writes, under ``root``."""
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        callbacks=[callback],
        **schedule,
    )


def _hf_run(tmp_path: Path, model: Any, callback: Any, folder: str = "") -> None:
    """Three optimizer steps of two accumulated micro-batches of a tiny causal LM under ``Trainer``."""
    import transformers

    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / folder),
        max_steps=3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()


def _tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="the hf extra: pip install 'trainledger[hf]'")
    pytest.importorskip("accelerate", reason="Trainer needs accelerate: pip install 'trainledger[hf]'")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def test_hf_trainer_callback_records_a_step(tmp_path: Path) -> None:
    model = _tiny_gpt2()
    from trainledger.integrations.hf import TrainledgerCallback

    callback = TrainledgerCallback(step=1)
    _hf_run(tmp_path, model, callback)
    assert callback.written is not None
    assert callback.written.ledger == tmp_path / "trainledger" / "step-1" / "rank-0.json"
    check_written(callback.written.ledger, callback.written.html, micro_batches=2)


class _Raised(RuntimeError):
    """The user's error, raised inside the training run."""


def test_hf_trainer_callback_leaves_nothing_running_when_training_raises(tmp_path: Path) -> None:
    """A Trainer has no hook for an error. One raised in the recorded step's forward ends the recording there
    (its dispatch mode would trace every later op of the process); one raised elsewhere (backward) is left
    until the next run begins: the same callback's next ``train()``, or another callback's recording, which
    says so. Either way the next run records its step."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from trainledger.integrations.hf import TrainledgerCallback

    model = _tiny_gpt2()
    calls = 0

    def raise_in_forward(_module: nn.Module, _args: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:  # the recorded step's first micro-batch
            raise _Raised("forward")

    hook = model.transformer.h[0].register_forward_pre_hook(raise_in_forward)
    callback = TrainledgerCallback(step=1)
    with pytest.raises(_Raised, match="forward"):
        _hf_run(tmp_path, model, callback, "a")
    hook.remove()
    assert _get_current_dispatch_mode() is None and not model._forward_pre_hooks and not model._forward_hooks
    assert callback.written is None

    def raise_in_backward(grad: torch.Tensor) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:  # the recorded step's first micro-batch
            raise _Raised("backward")

    def in_backward(_module: nn.Module, _args: Any, out: torch.Tensor) -> None:
        out.register_hook(raise_in_backward)

    calls = 0
    hook = model.transformer.wte.register_forward_hook(in_backward)
    with pytest.raises(_Raised, match="backward"):
        _hf_run(tmp_path, model, callback, "b")  # the same callback's next run: step 1 again
    hook.remove()
    assert _get_current_dispatch_mode() is not None  # in the tracer of the step that raised, until a run begins
    _hf_run(tmp_path, model, callback, "c")  # the same callback, once more: its step is recorded
    assert _get_current_dispatch_mode() is None
    assert callback.written is not None and callback.written.ledger.parent.parent.parent.name == "c"

    calls = 0
    hook = model.transformer.wte.register_forward_hook(in_backward)
    with pytest.raises(_Raised, match="backward"):
        _hf_run(tmp_path, model, TrainledgerCallback(step=1), "d")
    hook.remove()
    other = TrainledgerCallback(step=1)
    with pytest.warns(UserWarning, match="left open by an earlier training run"):
        _hf_run(tmp_path, model, other, "e")
    assert _get_current_dispatch_mode() is None
    assert other.written is not None
    check_written(other.written.ledger, other.written.html, micro_batches=2)


def test_lightning_callback_leaves_record_when_training_raises(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch", reason="the lightning extra: pip install 'trainledger[lightning]'")
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from trainledger.integrations.lightning import TrainledgerCallback

    class Fails(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 1)

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            if index == 1:
                raise RuntimeError("the user's bug")
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Fails()
    data = torch.utils.data.TensorDataset(torch.randn(32, 8))
    trainer = _quiet_trainer(pl, tmp_path, TrainledgerCallback(step=1), max_steps=3)
    with pytest.raises(RuntimeError, match="the user's bug"):
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    assert _get_current_dispatch_mode() is None and not module._forward_pre_hooks  # nothing left behind


def test_lightning_callback_checks_its_folder_when_made_and_a_step_it_cannot_write_only_warns(tmp_path: Path) -> None:
    """A folder that cannot be one is refused as the callback is made; one that fails only as the step is written
    (a file where a parent folder must be) warns and training goes on to its last step."""
    pl = pytest.importorskip("lightning.pytorch", reason="the lightning extra: pip install 'trainledger[lightning]'")
    from trainledger.errors import InputError
    from trainledger.integrations.lightning import TrainledgerCallback

    (tmp_path / "a-file").write_text("the user's")
    for bad, message in ((123, "give the folder to write under"), (tmp_path / "a-file", "is a file, not a folder")):
        with pytest.raises(InputError, match=message):
            TrainledgerCallback(output_dir=bad)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="html='no'"):
        TrainledgerCallback(html="no")  # type: ignore[arg-type]

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 1)

        def training_step(self, batch: list[torch.Tensor], _index: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = TrainledgerCallback(step=1, output_dir=tmp_path / "a-file" / "below")
    trainer = _quiet_trainer(pl, tmp_path, callback, max_steps=3)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8))
    with pytest.warns(UserWarning, match="step 1 was recorded but not written"):
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    assert trainer.global_step == 3 and callback.written is None and callback.recorder.unwritten
    assert (tmp_path / "a-file").read_text() == "the user's"


def test_lightning_callback_records_a_step(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch", reason="the lightning extra: pip install 'trainledger[lightning]'")
    from trainledger.integrations.lightning import TrainledgerCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _index: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    callback = TrainledgerCallback(step=1)
    trainer = _quiet_trainer(pl, tmp_path, callback, max_steps=3, accumulate_grad_batches=2)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    assert callback.written is not None
    assert callback.written.ledger == tmp_path / "trainledger" / "step-1" / "rank-0.json"
    check_written(callback.written.ledger, callback.written.html, micro_batches=2)
    # the loss, computed outside the modules inside optimizer.step(closure), is forward as in any loop
    losses = {ev.phase for ev in open_saved(callback.written.ledger).result.events if ev.op == "aten.mse_loss"}
    assert losses == {"forward"}


def test_lightning_callback_records_a_manually_optimized_gan_and_warns_when_the_step_never_comes(
    tmp_path: Path,
) -> None:
    """Lightning counts every optimizer's step: a GAN stepping two optimizers by hand begins its batches at global
    steps 0, 2, 4. ``step=1`` never matched and nothing was written, without a word; now the first batch beginning
    at 1 or later is recorded (its folder named after the step it began at), and a run too short warns."""
    pl = pytest.importorskip("lightning.pytorch", reason="the lightning extra: pip install 'trainledger[lightning]'")
    from trainledger.integrations.lightning import TrainledgerCallback

    class GAN(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.G = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
            self.D = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, batch: list[torch.Tensor], _index: int) -> None:
            opt_g, opt_d = self.optimizers()
            (real,) = batch
            fake = self.G(torch.randn(real.shape[0], 8))
            loss_d = self.D(real).mean() - self.D(fake.detach()).mean()
            opt_d.zero_grad()
            self.manual_backward(loss_d)
            opt_d.step()
            opt_g.zero_grad()
            self.manual_backward(self.D(fake).mean())
            opt_g.step()

        def configure_optimizers(self) -> list[torch.optim.Optimizer]:
            return [torch.optim.Adam(self.G.parameters()), torch.optim.Adam(self.D.parameters())]

    def fit(callback: TrainledgerCallback, batches: int) -> None:
        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(4 * batches, 4))
        trainer = _quiet_trainer(pl, tmp_path, callback, max_epochs=1)
        trainer.fit(GAN(), torch.utils.data.DataLoader(data, batch_size=4))

    callback = TrainledgerCallback(step=1, html=False)
    fit(callback, batches=3)
    assert callback.written is not None
    assert callback.written.ledger == tmp_path / "trainledger" / "step-2" / "rank-0.json"
    led = open_saved(callback.written.ledger).result
    assert {"forward", "backward", "optimizer"} <= {ev.phase for ev in led.events}

    late = TrainledgerCallback(step=9, html=False)
    with pytest.warns(UserWarning, match="step 9 was not recorded"):
        fit(late, batches=2)
    assert late.written is None
