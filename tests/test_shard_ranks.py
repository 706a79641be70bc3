"""Identical ranks are computed once: checked against every rank computed on its own.

The transform used to build one ledger per rank; it now builds one per class of identical ranks. The
oracle is the per-rank computation itself (``rank_ledger``), run for every rank of small
worlds: each rank's ledger must be exactly the one of its class.
"""

from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_shard_transform import _traced, paper_ledger
from trainledger.declared import StateSpec, declared_ledger
from trainledger.shard import ENGINES, STRATEGIES, ShardConfig, greedy_owners, shard, shard_rows
from trainledger.shard._config import plan_for
from trainledger.shard._context import Context
from trainledger.shard._partition import rank_boundaries
from trainledger.shard._transform import rank_ledger


def _every_rank_alone(ledger, config):
    res = shard(ledger, config)
    ctx = Context(ledger, config, plan_for(config), res.units)
    return res, [rank_ledger(ctx, r) for r in range(config.world_size)]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", [2, 3, 4, 5, 7, 12, 13])
def test_each_rank_is_exactly_its_class(strategy, engine, world):
    nodes = 2 if strategy == "hybrid_shard" and world % 2 == 0 else 1
    config = ShardConfig(world_size=world, strategy=strategy, engine=engine, num_nodes=nodes)
    checked = 0
    for ledger in (_traced(), declared_ledger(StateSpec(num_params=1001, master="fp32"))):
        res, alone = _every_rank_alone(ledger, config)
        assert len(res.ranks) == world
        for r, expected in enumerate(alone):
            assert res.ranks[r].entries == expected.entries and res.ranks[r].events == expected.events, r
            checked += 1
        assert sum(count for _, _, count, _ in res.rank_classes()) == world
    assert checked == 2 * world


def test_a_world_of_a_trillion_ranks_takes_no_longer_than_a_small_one():
    world = 10**12
    start = time.perf_counter()
    res = shard(paper_ledger(), world_size=world, strategy="zero3")
    seconds = time.perf_counter() - start
    assert seconds < 2
    assert len(res.ranks) == world and res.ranks[-1] is res.ranks[world - 1]
    classes = res.rank_classes()
    assert len(classes) <= 3 and sum(c[2] for c in classes) == world
    # every rank holds ceil(P / N) padded elements of each array; the last ranks hold no real ones
    assert res.model_state_bytes(world - 1) == res.model_state_bytes(0)
    d = res.to_dict()
    assert [(r["rank"], r["num_ranks"]) for r in d["ranks"]] == [(c[0], c[2]) for c in classes]
    assert any("distinct rank" in n for n in d["notes"])


def test_shard_command_with_a_trillion_ranks(cli_json):
    d = cli_json("shard", "--params", "1e9", "--world", "1000000000000", "--stage", "3")
    assert sum(r["num_ranks"] for r in d["ranks"]) == 10**12
    assert d["ranks"][0]["model_state_bytes"] == 12  # 16 bytes of state per parameter, one element each


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.integers(min_value=0, max_value=50), max_size=12), st.integers(min_value=1, max_value=20))
def test_greedy_owners_without_a_slot_per_rank_matches_the_plain_loop(sizes, num_ranks):
    owners, load = [0] * len(sizes), [0] * num_ranks
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        rank = min(range(num_ranks), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += sizes[i]
    assert greedy_owners(sizes, num_ranks) == owners


@settings(max_examples=300, deadline=None, database=None)
@given(
    st.lists(st.integers(min_value=0, max_value=12), max_size=2),
    st.integers(min_value=1, max_value=30),
    st.sampled_from(["dim0", "flat"]),
)
def test_partition_boundaries_are_exactly_where_a_rank_holds_something_else(shape, num_shards, partition):
    numel = 1
    for d in shape:
        numel *= d
    held = [shard_rows(numel, tuple(shape), num_shards, r, partition) for r in range(num_shards)]
    starts = [0, *rank_boundaries(numel, tuple(shape), num_shards, partition)]
    assert starts == sorted(set(starts))
    for r in range(num_shards):
        first = max(s for s in starts if s <= r)
        assert held[r] == held[first]
    assert all(held[a] != held[b] for a, b in itertools.pairwise(starts))  # no class split in two
