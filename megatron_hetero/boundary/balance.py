"""Encoder load balancing: which of an encoder's DP ranks encodes each item (an image or tile, a clip)
of a global microbatch. Pure numpy; every rank computes the same assignment from the batch metadata.

The boundary addresses rows by (sample, position) and routes each to the LLM rank that consumes it,
so an encoder DP rank may take any items, independent of which LLM DP rank consumes their rows:
items go to ranks by cost, not by sample. A transformer layer's work on an item of t tokens and
width h is the linear part, about 24 h^2 t multiply-adds, plus attention over the item, about
4 h t^2: in units of the linear part per token, `t + t^2 / (6 h)`.
"""

import heapq

import numpy as np

from megatron_hetero.spec.layout import dp_rank_of


def item_cost(tokens, hidden: int) -> np.ndarray:
    """Relative encoder work of items of `tokens` tokens each (linear layers plus attention)."""
    t = np.asarray(tokens, dtype=np.float64)
    return t + t * t / (6 * hidden)


def balance_items(costs, dp: int) -> np.ndarray:
    """Each item's DP rank (int64 [items]): longest processing time first, each item to the least
    loaded rank (the lowest on ties), which keeps the busiest rank within 4/3 of the optimum.
    Deterministic, so that every rank computes the same assignment; equal costs go round robin."""
    costs = np.asarray(costs, dtype=np.float64)
    if costs.size == 0 or (costs == costs[0]).all():  # what the loop gives equal costs, without it
        return np.arange(len(costs), dtype=np.int64) % dp
    assignment = np.empty(len(costs), dtype=np.int64)
    loads = [(0.0, rank) for rank in range(dp)]
    for item in np.argsort(-costs, kind="stable"):
        load, rank = heapq.heappop(loads)
        assignment[item] = rank
        heapq.heappush(loads, (load + costs[item], rank))
    return assignment


def assign_items(tokens, hidden: int, dp: int) -> np.ndarray:
    """Each item's encoder DP rank, balanced by the cost of its `tokens` in an encoder of width `hidden`."""
    if dp == 1:
        return np.zeros(len(tokens), dtype=np.int64)
    return balance_items(item_cost(tokens, hidden), dp)


def by_sample(items_per_sample, dp: int) -> np.ndarray:
    """Each item's DP rank when every rank takes a contiguous slice of the samples (Megatron's data
    parallelism, the unbalanced baseline; the samples must split evenly)."""
    counts = np.asarray(items_per_sample, dtype=np.int64)
    assert len(counts) % dp == 0, "by_sample needs the samples to split evenly over the ranks"
    return np.repeat(dp_rank_of(np.arange(len(counts)), len(counts), dp), counts)


def rank_loads(costs, assignment: np.ndarray, dp: int) -> np.ndarray:
    """The summed cost of each rank's items."""
    return np.bincount(assignment, weights=np.asarray(costs, dtype=np.float64), minlength=dp)


def imbalance(loads) -> float:
    """max / mean - 1 of per-rank loads or times (0: perfectly even)."""
    loads = np.asarray(loads, dtype=np.float64)
    return float(loads.max() / loads.mean() - 1) if loads.size and loads.mean() > 0 else 0.0


def skewed_batch(num_samples: int, sizes: tuple[int, ...], seed: int, most_images: int = 16):
    """A skewed global batch for measurements: each sample has 1..most_images images, each of a size
    drawn from `sizes` (pixels), larger samples rarer. Returns (images per sample, size of each image)."""
    rng = np.random.default_rng(seed)
    counts = np.minimum(rng.geometric(2.5 / most_images, num_samples), most_images)
    return counts, rng.choice(np.asarray(sizes), int(counts.sum()))
