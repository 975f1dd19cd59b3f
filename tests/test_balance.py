"""Encoder load balancing (boundary/balance.py): the assignment against brute force and its bound,
and the imbalance on skewed batches within 5% of the mean in the cost model (measured times:
benchmarks/bench_balance.py)."""

import itertools

import numpy as np
import pytest

from megatron_hetero.boundary.balance import (
    assign_items,
    balance_items,
    by_sample,
    imbalance,
    item_cost,
    rank_loads,
    skewed_batch,
)


def _optimum(costs, dp):
    """The least possible busiest-rank load, by trying every assignment."""
    return min(rank_loads(costs, np.array(a), dp).max() for a in itertools.product(range(dp), repeat=len(costs)))


@pytest.mark.parametrize("seed", range(30))
def test_within_the_lpt_bound_of_the_optimum(seed):
    rng = np.random.default_rng(seed)
    dp, n = int(rng.integers(2, 4)), int(rng.integers(1, 8))
    costs = item_cost(rng.choice([64, 256, 576, 1024], n), 1024)
    busiest = rank_loads(costs, balance_items(costs, dp), dp).max()
    optimum = _optimum(costs, dp)
    assert optimum <= busiest <= (4 / 3 - 1 / (3 * dp)) * optimum + 1e-9


def test_equal_items_go_round_robin_and_every_item_once():
    assert balance_items(np.ones(7), 3).tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert assign_items([5] * 4, 8, 1).tolist() == [0] * 4
    assert assign_items([], 8, 4).tolist() == []


def test_cost_counts_attention_quadratically():
    """Per layer: 24 h^2 t multiply-adds in the linear layers, 4 h t^2 in attention."""
    h, t = 64, np.array([16, 256, 4096])
    flops = 24 * h * h * t + 4 * h * t * t
    assert np.allclose(item_cost(t, h), flops / (24 * h * h))


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_skewed_batches_balance_within_five_percent(dp):
    """1-16 images of 224-448 px (256-1024 tokens of a 1024-wide ViT) per sample, 64 samples: the
    busiest rank within 5% of the mean after balancing, far above it when ranks take samples."""
    for seed in range(5):
        counts, pixels = skewed_batch(64, (224, 336, 448), seed)
        costs = item_cost((pixels // 14) ** 2, 1024)
        balanced = imbalance(rank_loads(costs, balance_items(costs, dp), dp))
        before = imbalance(rank_loads(costs, by_sample(counts, dp), dp))
        assert balanced <= 0.05 and before > 2 * balanced, (seed, before, balanced)
        assert counts.min() >= 1 and counts.max() <= 16

