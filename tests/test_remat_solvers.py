"""The rematerialization solvers against brute force over every subset, and against each other."""

from __future__ import annotations

import random

import numpy as np
import pytest

from trainledger.errors import InputError
from trainledger.remat import (
    Chain,
    LinearModel,
    NoPlan,
    brute_force,
    chain_savings,
    min_peak,
    solve,
    solve_dp,
    solve_greedy,
    solve_milp,
    sqrt_n_choice,
    uniform_chain_model,
)


def _random_chain(rng: random.Random, n: int) -> LinearModel:
    return uniform_chain_model(
        num_blocks=n,
        saved_bytes=[rng.randint(1, 50) for _ in range(n)],
        input_bytes=[rng.randint(1, 10) for _ in range(n)],
        transient_bytes=[rng.randint(0, 30) for _ in range(n)],
        grad_bytes=[rng.randint(0, 20) for _ in range(n)],
        base_bytes=rng.randint(0, 100),
        cost=[float(rng.randint(1, 9)) for _ in range(n)],
        head_bytes=rng.randint(0, 40),
    )


def test_hand_chain_numbers():
    # 4 blocks, 10 saved bytes each, inputs 2, transient 3, grads 1, 100 persistent.
    m = uniform_chain_model(
        num_blocks=4, saved_bytes=10, input_bytes=2, transient_bytes=3, grad_bytes=1, base_bytes=100
    )
    # plain peak: end of forward = 100 + 4*10 + 4*2 = 148; backward of block 3 adds grad 1 and input grad 2
    # at the backward of block 3: 100 + 40 + 8 + 1 + 2 = 151 (hand calculation)
    assert m.peak(()) == 151
    # all recomputed: backward of block 3 = 100 + 8 (inputs) + 10 (its recomputed) + 1 + 2 = 121
    assert m.peak(range(4)) == 121
    # budget 141: one block must go; saving 10 during block 3's backward -> 141 exactly
    assert solve_dp(m, 141).cost == 1.0 and solve_dp(m, 140).cost == 2.0


@pytest.mark.parametrize("seed", range(40))
def test_dp_and_milp_match_brute_force(seed):
    rng = random.Random(seed)
    m = _random_chain(rng, rng.randint(1, 8))
    lo, hi = m.peak(tuple(range(m.num_candidates))), m.peak(())
    num_feasible = 0
    for budget in sorted({lo - 1, lo, (lo + hi) // 2, rng.randint(min(lo, hi), hi), hi}):
        oracle = brute_force(m, budget)
        if oracle is None:
            with pytest.raises(NoPlan):
                solve_dp(m, budget)
            with pytest.raises(NoPlan):
                solve_milp(m, budget)
            continue
        num_feasible += 1
        dp, milp = solve_dp(m, budget), solve_milp(m, budget)
        assert dp.cost == pytest.approx(oracle[1]) and milp.cost == pytest.approx(oracle[1])
        assert dp.peak_bytes <= budget and milp.peak_bytes <= budget
        assert dp.optimal and milp.optimal and milp.gap == 0.0
        assert milp.lp_bound is not None and milp.lp_bound <= milp.cost + 1e-9
        greedy = solve_greedy(m, budget)
        assert greedy.peak_bytes <= budget and greedy.cost >= oracle[1] - 1e-9
    assert num_feasible > 0  # the plain peak itself is always a feasible budget


def test_conflicting_candidates_are_never_chosen_together():
    # Two candidates cover the same atom; together they would fit, but they are alternatives.
    m = LinearModel(
        np.array([100, 100]),
        np.array([[-30, -30], [-30, -30], [-5, -5]]),
        np.array([1.0, 1.0, 10.0]),
        (frozenset({"a"}), frozenset({"a"}), frozenset({"b"})),
        ("a-full", "a-selective", "b"),
    )
    assert brute_force(m, 40) is None
    with pytest.raises(NoPlan):
        solve_milp(m, 40)
    assert solve_milp(m, 70).choice in ((0,), (1,))
    assert solve_milp(m, 66).choice in ((0, 2), (1, 2))


def test_dp_with_alternative_options_matches_milp():
    rng = random.Random(7)
    n = 5
    base = _random_chain(rng, n)
    # a second, cheaper and weaker option per block: half the saving at a third of the cost
    extra = base.delta // 2
    model = LinearModel(
        base.base,
        np.vstack([base.delta, extra]),
        np.r_[base.cost, base.cost / 3],
        base.covers + base.covers,
        base.names + tuple(f"{x}-selective" for x in base.names),
        chain=Chain(tuple(((), (i,), (i + n,)) for i in range(n)), base.chain.span, base.chain.prefix),
    )
    chain_savings(model)
    lo, hi = min_peak(model)[0], model.peak(())
    for budget in np.linspace(lo, hi, 7).astype(int):
        oracle = brute_force(model, int(budget))
        assert oracle is not None
        assert solve_dp(model, int(budget)).cost == pytest.approx(oracle[1])
        assert solve_milp(model, int(budget)).cost == pytest.approx(oracle[1])


def test_min_peak_is_the_lowest_feasible_budget():
    rng = random.Random(3)
    m = _random_chain(rng, 6)
    floor, choice = min_peak(m)
    assert m.peak(choice) == floor
    assert brute_force(m, floor) is not None and brute_force(m, floor - 1) is None


def test_discretised_dp_stays_feasible():
    rng = random.Random(11)
    m = _random_chain(rng, 12)
    budget = (m.peak(()) + min_peak(m)[0]) // 2
    exact = solve_dp(m, budget)
    assert exact.optimal
    num_solved = 0
    for states in (4, 16, 64):
        try:
            coarse = solve_dp(m, budget, max_states=states)
        except NoPlan:  # a coarse grid may lose every plan; it never returns an infeasible one
            continue
        assert coarse.peak_bytes <= budget and coarse.cost >= exact.cost
        num_solved += 1
    assert num_solved > 0, "every grid lost every plan: nothing checked"


def test_sqrt_n_segments():
    # 9 blocks, segments of 3: the last block of each segment keeps its activations
    assert sqrt_n_choice(list(range(9))) == (0, 1, 3, 4, 6, 7)
    assert sqrt_n_choice([5]) == (5,)


def test_auto_uses_dp_on_chains_and_milp_otherwise():
    m = _random_chain(random.Random(1), 4)
    budget = m.peak(())
    assert solve(m, budget).solver == "dp"
    general = LinearModel(m.base, m.delta, m.cost, m.covers, m.names)
    assert solve(general, budget).solver == "milp"


def test_an_unknown_solver_is_refused_before_anything_is_traced():
    from trainledger.examples import gpt_tiny
    from trainledger.remat import plan

    with pytest.raises(InputError, match="unknown solver 'fast'"):
        plan(gpt_tiny(), "50%", solver="fast")  # type: ignore[arg-type]
