"""Plans that run: apply/remove, JSON by module path, and the oracle: gradients equal to the plain step's."""

from __future__ import annotations

import json
import re

import pytest
import torch

from trainledger.errors import InputError
from trainledger.examples import gpt_tiny
from trainledger.remat import Plan, Region, structure_fingerprint
from trainledger.workload import Workload, call_model, compute_loss


def _grads(w: Workload, seed: int = 1234) -> dict[str, torch.Tensor]:
    """One forward+backward with dropout on, from a fixed RNG state; returns every parameter's gradient."""
    w.model.train()
    w.model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = compute_loss(w, call_model(w.model, w.batch))
    loss.backward()
    return {n: p.grad.clone() for n, p in w.model.named_parameters() if p.grad is not None}


PLANS = [
    (Region("blocks.0"), Region("blocks.1"), Region("blocks.2"), Region("blocks.3")),
    (Region("blocks.1.attn"), Region("blocks.1.mlp"), Region("blocks.3")),
    (Region("blocks.0", "selective"), Region("blocks.2", "selective"), Region("blocks.3.mlp")),
]


@pytest.mark.slow
@pytest.mark.parametrize("regions", PLANS)
def test_gradients_bitwise_equal_with_dropout(regions):
    plain = _grads(gpt_tiny())
    w = gpt_tiny()
    plan = Plan(regions=regions, fingerprint=structure_fingerprint(w.model))
    plan.apply(w.model)
    planned = _grads(w)
    assert planned.keys() == plain.keys()
    for name, g in plain.items():
        assert torch.equal(planned[name], g), name  # bitwise, not approximately
    # dropout really was on: another seed gives other gradients
    other = _grads(gpt_tiny(), seed=99)
    assert not torch.equal(other["blocks.0.mlp.fc.weight"], plain["blocks.0.mlp.fc.weight"])


def test_remove_restores_the_exact_model():
    w = gpt_tiny()
    before_state = {k: v.clone() for k, v in w.model.state_dict().items()}
    before_forward = {n: m.__dict__.get("forward") for n, m in w.model.named_modules()}
    plan = Plan(regions=PLANS[1], fingerprint=structure_fingerprint(w.model))
    plan.apply(w.model)
    assert "forward" in w.model.get_submodule("blocks.1.attn").__dict__
    plan.remove(w.model)
    assert {n: m.__dict__.get("forward") for n, m in w.model.named_modules()} == before_forward
    assert all(not any(k.startswith("_trainledger") for k in m.__dict__) for m in w.model.modules())
    after = w.model.state_dict()
    assert after.keys() == before_state.keys() and all(torch.equal(after[k], before_state[k]) for k in after)


def test_json_round_trip_and_structure_check(tmp_path):
    w = gpt_tiny()
    plan = Plan(regions=PLANS[2], fingerprint=structure_fingerprint(w.model), model="gpt-tiny", extra_flops=7)
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan
    assert json.loads(path.read_text())["regions"][0] == {"path": "blocks.0", "policy": "selective"}
    other = gpt_tiny(n_layer=2)
    with pytest.raises(InputError, match="does not have"):
        loaded.apply(other.model)  # blocks.2 is missing
    wider = gpt_tiny(n_embd=32)
    with pytest.raises(InputError, match="another structure"):
        Plan(regions=(Region("blocks.0"),), fingerprint=plan.fingerprint).apply(wider.model)


def test_applying_twice_and_bad_files_are_clear_errors(tmp_path):
    w = gpt_tiny()
    plan = Plan(regions=(Region("blocks.0"),), fingerprint=structure_fingerprint(w.model))
    plan.apply(w.model)
    with pytest.raises(InputError, match="already runs under a plan"):
        plan.apply(w.model)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="is not JSON"):
        Plan.load(bad)
    bad.write_text('{"schema": "something/1"}')
    with pytest.raises(InputError, match="not a trainledger plan"):
        Plan.load(bad)
    with pytest.raises(InputError, match="does not exist"):
        Plan.load(tmp_path / "absent.json")
    saved = plan.to_dict()
    bad.write_text(json.dumps({**saved, "regions": "blocks.0"}))  # one path, not a list: was "a str 'b'"
    with pytest.raises(InputError, match=r"its regions are a str 'blocks\.0', not a list of regions"):
        Plan.load(bad)
    with pytest.raises(InputError, match="policy 'sometimes'"):
        Plan(regions=(Region("blocks.1", "sometimes"),), fingerprint=plan.fingerprint).check(w.model)  # type: ignore[arg-type]


def test_plan_json_keys_are_stable():
    """The plan file's schema: a change here is a change users' saved plans see."""
    w = gpt_tiny(n_layer=1)
    d = Plan(regions=(Region("blocks.0"),), fingerprint=structure_fingerprint(w.model)).to_dict()
    assert sorted(d) == [
        "budget_bytes",
        "cuda_device",
        "extra_flops",
        "extra_other_flops",
        "extra_seconds",
        "fingerprint",
        "floor_bytes",
        "kernel_kind",
        "lp_bound",
        "model",
        "optimal",
        "optimality_gap",
        "plain_peak_bytes",
        "plan_notes",
        "policies",
        "predicted_peak_bytes",
        "regions",
        "schema",
        "solver",
    ]
    assert d["schema"] == "trainledger.remat-plan/1"


def test_a_model_that_draws_its_path_at_random_is_planned_and_its_generator_left_as_it_was():
    """Stochastic depth (a block skipped when ``torch.rand`` says so): the forward recorded for the solver ran
    several times from wherever the generator had got to, took other paths, and ``plan`` raised IndexError.
    Each run starts from the same state now, and the state is what it was before planning."""
    from torch import nn

    from trainledger.remat import plan

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(16, 48), nn.Linear(48, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.training and torch.rand(()) < 0.5:
                return x
            return x + self.down(torch.relu(self.up(x)))

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 16), *(Block() for _ in range(6)))
    w = Workload(model, torch.randn(64, 16), loss_fn=lambda out, _batch: out.square().mean())
    before = torch.get_rng_state()
    p = plan(w, "95%", cost="flops")
    assert torch.equal(torch.get_rng_state(), before)
    assert p.predicted_peak_bytes is not None and p.predicted_peak_bytes <= p.budget_bytes


def test_a_region_inside_another_and_a_model_checkpointing_its_own_layers_are_refused(tmp_path):
    """Both would run a checkpoint inside another's recomputation, which saves other tensors than the forward
    did: backward raised CheckpointError, after ``check`` had passed the plan (a saved plan applied to the same
    Hugging Face model after ``gradient_checkpointing_enable()`` has the same fingerprint)."""
    transformers = pytest.importorskip("transformers")
    from trainledger.remat import Region

    model = gpt_tiny().model
    fingerprint = structure_fingerprint(model)
    for regions, inner, outer in (
        (("blocks.1", "blocks.1.mlp"), "blocks.1.mlp", "blocks.1"),
        (("", "blocks.0"), "blocks.0", "(the whole model)"),
    ):
        plan = Plan(regions=tuple(Region(r) for r in regions), fingerprint=fingerprint)
        with pytest.raises(InputError, match=re.escape(f"region '{inner}' lies inside region '{outer}'")):
            plan.apply(model)
        assert not any("_trainledger" in k for m in model.modules() for k in m.__dict__)

    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8, use_cache=False)
    hf = transformers.GPT2LMHeadModel(config)
    plan = Plan(regions=(Region("transformer.h.0"),), fingerprint=structure_fingerprint(hf))
    on, off = (
        ("activation_checkpointing_enable", "activation_checkpointing_disable")
        if hasattr(hf, "activation_checkpointing_enable")  # transformers 5's names
        else ("gradient_checkpointing_enable", "gradient_checkpointing_disable")
    )
    getattr(hf, on)()
    path = tmp_path / "remat_policy.py"
    plan.export_policy(path)
    from tests.test_export_policy import load

    with pytest.raises(InputError, match="checkpoints its own layers"):
        plan.apply(hf)
    with pytest.raises(RuntimeError, match="checkpoints its own layers"):
        load(path).apply(hf)
    getattr(hf, off)()
    plan.apply(hf)
    plan.remove(hf)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing dynamo
def test_a_plan_given_torch_compiles_wrapper_says_to_apply_it_before_compiling():
    model = gpt_tiny().model
    plan = Plan(regions=(), fingerprint=structure_fingerprint(model))
    with pytest.raises(InputError, match=r"torch.compile's wrapper of the model: apply the plan .* before compiling"):
        plan.apply(torch.compile(model))


class _LayerDrop(torch.nn.Module):
    """Blocks skipped at random in training (wav2vec2's LayerDrop): which ones run follows torch's generator."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i == 0 or torch.rand(()) > 0.5:
                x = x + block(x)
        return x.square().mean()


def test_the_verification_re_traces_from_the_generator_state_the_plan_was_made_from():
    """The timed steps drew from torch's generator and left it moved on: the re-trace skipped other blocks than
    the comparisons did, and the traced peak was not the predicted one."""
    from trainledger.remat import Planner, verify

    torch.manual_seed(0)
    w = Workload(_LayerDrop(), torch.randn(32, 64))
    planner = Planner.build(w)
    plan = planner.solve(planner.floor_bytes)
    agreed = []
    for _ in range(3):
        planner.restore()
        v = verify(w, plan, repeats=2)
        agreed.append((v.traced_peak_bytes, v.predicted_peak_bytes, v.passed))
    assert agreed == [(plan.predicted_peak_bytes, plan.predicted_peak_bytes, True)] * 3


class _PythonLayerDrop(_LayerDrop):
    """The same, drawing from Python's generator (wav2vec2's adapter draws from NumPy's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import random

        for i, block in enumerate(self.blocks):
            if i == 0 or random.random() > 0.5:
                x = x + block(x)
        return x.square().mean()


def test_a_forward_that_draws_from_pythons_generator_is_recorded_on_the_traced_steps_path():
    """Each recording run restarted torch's generator only: runs took different paths, recorded different
    numbers of ops, and planning ended in an IndexError."""
    import random

    from trainledger.remat import Planner, verify

    torch.manual_seed(0)
    random.seed(3)
    w = Workload(_PythonLayerDrop(), torch.randn(32, 64))
    planner = Planner.build(w)
    plan = planner.solve(planner.floor_bytes)
    planner.restore()
    v = verify(w, plan, timing=False)
    assert v.passed and v.traced_peak_bytes == plan.predicted_peak_bytes


def test_the_forward_recorded_for_the_solver_takes_the_traced_steps_path():
    """The traced step follows a warm-up step; the recording's runs all started where the warm-up had, took its
    path instead (other blocks skipped), did not line up with the trace, and the costs fell back to estimates."""
    from trainledger.remat import Planner

    torch.manual_seed(0)
    planner = Planner.build(Workload(_LayerDrop(), torch.randn(32, 64)))
    assert not [n for n in planner.candidates.notes if "did not line up" in n]
    assert all(c.seconds < 1 for c in planner.candidates.candidates)  # measured, not a placeholder
