"""Boundary exactness over a matrix of layout pairs: forward rows and routed gradients equal a
single-process re-layout bit for bit, colocated (all-to-all, or all-gather) and non-colocated
(point-to-point)."""

import itertools
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_hetero.boundary import (
    BoundaryBatch,
    BoundaryError,
    BoundaryMismatch,
    assign_items,
    boundary_exchange,
    check_agreement,
    filled_slots,
    plan_edge,
    write_rows,
)
from megatron_hetero.boundary.non_colocated import backward_recvs, backward_sends, forward_recvs, forward_sends
from megatron_hetero.boundary.plan import disagreement, metadata_summary
from megatron_hetero.boundary.reference import at_addresses, encoder_share, llm_share, reference_input
from megatron_hetero.boundary.transfer import complete
from megatron_hetero.parallel.groups import build_module_groups
from megatron_hetero.spec.layout import ModuleLayout
from tests.distributed import run_distributed
from tests.row_plan import row_routes

HIDDEN = 8
DTYPES = (torch.float32, torch.bfloat16)


def enc(tp=1, cp=1, dp=1, pp=1, first=0, name="vision", replicated=False):
    return ModuleLayout(name, "encoder", tp=tp, cp=cp, dp=dp, pp=pp, first_rank=first, cp_replicated=replicated)


def llm(tp=1, cp=1, dp=1, pp=1, sp=False, first=0):
    return ModuleLayout("llm", "llm", tp=tp, cp=cp, dp=dp, pp=pp, sp=sp, first_rank=first)


def edge_batches(counts_per_edge, seq_len, seed):
    """One BoundaryBatch per edge; within a sample the edges' rows take disjoint random positions."""
    rng = np.random.default_rng(seed)
    positions = [[] for _ in counts_per_edge]
    for sample_counts in zip(*counts_per_edge):
        taken = rng.permutation(seq_len)
        for e, n in enumerate(sample_counts):
            positions[e].append(np.sort(taken[:n]))
            taken = taken[n:]
    return [BoundaryBatch(np.array(c), np.concatenate([[]] + p), seq_len)
            for c, p in zip(counts_per_edge, positions)]


def itemized(batch: BoundaryBatch, encoder_dp: int, seed: int) -> BoundaryBatch:
    """`batch` with each sample's rows cut into items of 1-3 rows (images of a sample), assigned to
    the encoder's DP ranks by cost as the runtime does (boundary.assign_items): any batch size, and
    a rank may get no item."""
    rng = np.random.default_rng(seed)
    items = []
    for n in batch.rows_per_sample:
        while n:
            items.append(min(n, int(rng.integers(1, 4))))
            n -= items[-1]
    return replace(batch, item_rows=np.array(items, dtype=np.int64),
                   item_dp=assign_items(np.array(items), HIDDEN, encoder_dp))


def _patterns(batch, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(batch.num_rows, HIDDEN, generator=gen).to(dtype)
    grad = torch.randn(batch.seq_len, batch.num_samples, HIDDEN, generator=gen).to(dtype)
    return rows, grad


# ---- colocated: autograd all-to-all ------------------------------------------------------------

def _check_colocated(rank, world_size, encoders, llm_layout, batches, dtype, tp_group=None):
    """Forward rows and gradients equal the single-process re-layout; with `tp_group` (the LLM's TP
    group) through the all-gather where the plan is one. Returns the edges that gathered here."""
    merged = None
    sources = []
    gathered = 0
    for e, (encoder, batch) in enumerate(zip(encoders, batches)):
        rows, grad = _patterns(batch, dtype, seed=e)
        plan = plan_edge(batch, encoder, llm_layout, rank, world_size)
        gathered += tp_group is not None and plan.gather is not None
        local = encoder_share(rows, batch, encoder, rank).clone().requires_grad_(True)
        got = boundary_exchange(local, plan, llm_tp_group=tp_group)
        mask = llm_share(reference_input(torch.ones(batch.num_rows, 1), batch), llm_layout, rank)
        filled = filled_slots(plan, "cpu")
        assert torch.equal(filled, mask.reshape(-1).nonzero().squeeze(1))
        mine = llm_share(reference_input(rows, batch), llm_layout, rank)
        assert torch.equal(got, mine[filled]), f"rank {rank}: edge {encoder.name} forward rows differ"
        slots = torch.zeros_like(mine).index_copy(0, filled, got)
        merged = slots if merged is None else merged + slots  # edges fill disjoint positions
        sources.append((local, grad, encoder, batch))
    # One backward through all edges, as the LLM's input gradient would drive it.
    grad_full = sum(torch.where(reference_input(torch.ones(b.num_rows, 1), b) > 0, g, 0)
                    for _, g, _, b in sources)
    merged.backward(llm_share(grad_full, llm_layout, rank))
    for local, grad, encoder, batch in sources:
        want = encoder_share(at_addresses(grad, batch), batch, encoder, rank)
        assert torch.equal(local.grad, want), f"rank {rank}: edge {encoder.name} gradients differ"
    return gathered


def _colocated_cases(rank, world_size, cases, batch_specs, items=False, gather=False):
    """`gather`: each check again with the LLM's TP group as the runtime builds it, so that the
    edges the plan makes gathers run the all-gather (and some must)."""
    gathered = 0
    for encoders, llm_layout in cases:
        tp_groups = (None, build_module_groups(llm_layout).pgs.tp) if gather else (None,)
        for seed, (counts, seq_len) in enumerate(batch_specs):
            batches = edge_batches([counts] * len(encoders), seq_len, seed)
            if items:
                batches = [itemized(b, e.dp, seed) for b, e in zip(batches, encoders)]
            for dtype, tp_group in itertools.product(DTYPES, tp_groups):
                gathered += _check_colocated(rank, world_size, encoders, llm_layout, batches, dtype, tp_group)
    assert gathered or not gather, f"rank {rank}: no edge ran the all-gather"


def _check_replicated(rank, world_size, encoder, llm_layout, batch, dtype):
    """An encoder replicated over cp (Megatron's homogeneous layout under LLM CP): every cp replica
    holds its DP rank's rows whole; forward rows as the reference; each row's gradient reaches the
    replicas at cp = (the consuming LLM CP rank) mod cp, zeros elsewhere, so that the sum over the
    replicas is the reference gradient. Ranks without the encoder (on the LLM's later stages) hold
    no rows."""
    rows, grad = _patterns(batch, dtype, seed=0)
    plan = plan_edge(batch, encoder, llm_layout, rank, world_size)
    whole = replace(encoder, cp=1, cp_replicated=False)  # a replica's rows: its DP rank's, whole
    c = encoder.coords(rank)
    replica = None if c is None else whole.rank_of(tp=c["tp"], dp=c["dp"], pp=c["pp"])  # None: no encoder here
    local = encoder_share(rows, batch, whole, replica).clone().requires_grad_(True)
    got = boundary_exchange(local, plan)
    mine = llm_share(reference_input(rows, batch), llm_layout, rank)
    filled = filled_slots(plan, "cpu")
    assert torch.equal(got, mine[filled]), f"rank {rank}: forward rows differ"
    slots = torch.zeros_like(mine).index_copy(0, filled, got)
    mask = reference_input(torch.ones(batch.num_rows, 1), batch) > 0
    slots.backward(llm_share(torch.where(mask, grad, 0), llm_layout, rank))
    chunk = torch.as_tensor(batch.positions) // (batch.seq_len // (2 * llm_layout.cp))
    llm_cp = torch.where(chunk < llm_layout.cp, chunk, 2 * llm_layout.cp - 1 - chunk)
    ours = (llm_cp % encoder.cp == (c["cp"] if c else -1)).to(dtype)[:, None] * at_addresses(grad, batch)
    want = encoder_share(ours, batch, whole, replica)
    assert torch.equal(local.grad, want), f"rank {rank}: gradients differ"


def _replicated_cases(rank, world_size, cases):
    for encoder, llm_layout in cases:
        for seed, (counts, seq_len) in enumerate(BATCHES_8):
            (batch,) = edge_batches([counts], seq_len, seed)
            for dtype in DTYPES:
                _check_replicated(rank, world_size, encoder, llm_layout, batch, dtype)


# ---- non-colocated: point-to-point, several microbatches in flight -----------------------------

def _check_non_colocated(rank, world_size, encoders, llm_layout, microbatches, dtype):
    """microbatches: per microbatch, one BoundaryBatch per edge. The transfers of all microbatches
    are in flight together (one posted batch per direction), as a pipeline schedule has them."""
    like = torch.empty(0, HIDDEN, dtype=dtype)
    plans, patterns, sends, recvs = {}, {}, [], {}
    for m, batches in enumerate(microbatches):
        for e, (encoder, batch) in enumerate(zip(encoders, batches)):
            plans[m, e] = plan = plan_edge(batch, encoder, llm_layout, rank, world_size)
            patterns[m, e] = _patterns(batch, dtype, seed=10 * m + e)
            if plan.num_source_rows:
                sends.append(forward_sends(encoder_share(patterns[m, e][0], batch, encoder, rank), plan))
            if plan.num_dest_slots:
                recvs[m, e] = forward_recvs(plan, like)
    received = complete(sends + list(recvs.values()))[len(sends):]
    for (m, e), got in zip(recvs, received):
        rows, _ = patterns[m, e]
        want = llm_share(reference_input(rows, microbatches[m][e]), llm_layout, rank)
        assert torch.equal(got, want[filled_slots(plans[m, e], "cpu")]), \
            f"rank {rank}: microbatch {m} edge {e} forward differs"

    sends, recvs = [], {}
    for (m, e), plan in plans.items():
        if plan.num_dest_slots:
            grad = llm_share(patterns[m, e][1], llm_layout, rank)
            sends.append(backward_sends(grad[filled_slots(plan, "cpu")], plan))
        if plan.num_source_rows:
            recvs[m, e] = backward_recvs(plan, like)
    received = complete(sends + list(recvs.values()))[len(sends):]
    for (m, e), grad_rows in zip(recvs, received):
        batch, (_, grad) = microbatches[m][e], patterns[m, e]
        want = encoder_share(at_addresses(grad, batch), batch, encoders[e], rank)
        assert torch.equal(grad_rows, want), f"rank {rank}: microbatch {m} edge {e} gradients differ"


def _non_colocated_cases(rank, world_size, cases, batch_specs, items=False):
    for encoders, llm_layout in cases:
        microbatches = [edge_batches([counts] * len(encoders), seq_len, seed)
                        for seed, (counts, seq_len) in enumerate(batch_specs)]
        if items:
            microbatches = [[itemized(b, e.dp, seed) for b, e in zip(batches, encoders)]
                            for seed, batches in enumerate(microbatches)]
        for dtype in DTYPES:
            _check_non_colocated(rank, world_size, encoders, llm_layout, microbatches, dtype)


# ---- the matrix --------------------------------------------------------------------------------

SEQ = 48  # divisible by 2*cp*tp for every LLM layout below
BATCHES_8 = [([1, 0, 2, 1, 3, 1, 0, 2], SEQ), ([0] * 8, SEQ), ([5, 5, 5, 5, 0, 0, 0, 0], SEQ)]
BATCHES_6 = [([2, 0, 1, 1, 2, 0], SEQ), ([0] * 6, SEQ), ([3, 1, 4, 1, 5, 9], SEQ)]
BATCHES_24 = [([i % 4 for i in range(24)], SEQ), ([0] * 24, SEQ)]

COLOCATED_4 = [
    ([enc(dp=4)], llm(tp=2, dp=2)),                    # DP fan-in, TP on the LLM
    ([enc(tp=2, dp=2)], llm(dp=4)),                    # DP fan-out, TP on the encoder
    ([enc(dp=4)], llm(tp=4)),
    ([enc(tp=4)], llm(dp=4)),
    ([enc(tp=2, dp=2)], llm(tp=2, dp=2)),              # same layout: nothing leaves a rank
    ([enc(dp=4)], llm(tp=2, dp=2, sp=True)),           # SP
    ([enc(dp=4)], llm(tp=2, cp=2, sp=True)),           # CP2 + SP
    ([enc(dp=4)], llm(cp=4)),                          # CP4
    ([enc(tp=2, dp=2)], llm(cp=2, dp=2)),
    ([enc(dp=2, pp=2)], llm(tp=2, dp=2)),              # encoder PP
    ([enc(dp=4)], llm(dp=2, pp=2)),                    # LLM PP
    ([enc(cp=2, dp=2)], llm(tp=4, sp=True)),           # encoder CP
    ([enc(cp=4)], llm(dp=4)),
    ([enc(tp=4)], llm(cp=2, pp=2)),
    ([enc(pp=4)], llm(tp=2, cp=2, sp=True)),
    ([enc(tp=2, pp=2)], llm(dp=2, pp=2)),              # PP on both sides
    ([enc(dp=4), enc(tp=2, dp=2, name="audio")], llm(tp=2, cp=2, sp=True)),  # two encoders
    ([enc(dp=2)], llm(dp=2, pp=2)),                    # encoder on the LLM's first stage (ranks 0-1)
    ([enc(tp=2)], llm(tp=2, pp=2, sp=True)),           # ... with the stage's TP and SP
]
COLOCATED_3 = [([enc(dp=3)], llm(tp=3)), ([enc(tp=3)], llm(dp=3))]           # DP 3 -> 1, 1 -> 3
COLOCATED_6 = [([enc(tp=3, dp=2)], llm(dp=6)), ([enc(dp=6)], llm(tp=3, dp=2, sp=True))]  # 2 -> 6, 6 -> 2
GATHER_6 = [([enc(dp=6)], llm(tp=3, dp=2)), ([enc(dp=2)], llm(tp=2, pp=3))]  # all-gathers: 2 groups; stage 0
COLOCATED_8 = [
    ([enc(dp=8)], llm(tp=2, cp=4, sp=True)),           # CP4 + SP
    ([enc(cp=2, dp=2, pp=2)], llm(tp=2, cp=2, pp=2)),  # CP and PP on both sides
]
NON_COLOCATED_4 = [
    ([enc(dp=1)], llm(dp=3, first=1)),                            # 1 rank -> DP3
    ([enc(dp=3)], llm(first=3)),                                  # DP3 -> 1 rank
    ([enc(pp=2)], llm(pp=2, first=2)),                            # PP on both sides
    ([enc(dp=2)], llm(tp=2, sp=True, first=2)),
    ([enc(dp=2)], llm(tp=2, first=2)),                            # TP replicas, one returns
    ([enc(), enc(first=1, name="audio")], llm(cp=2, first=2)),    # two encoders
]
NON_COLOCATED_8 = [
    ([enc(dp=2)], llm(dp=6, first=2)),                            # DP 2 -> 6
    ([enc(cp=2, dp=2)], llm(cp=4, first=4)),                      # encoder CP -> LLM CP4
    ([enc(dp=2, pp=2)], llm(tp=2, pp=2, sp=True, first=4)),
    ([enc(tp=2)], llm(tp=3, dp=2, sp=True, first=2)),
]


def test_matrix_has_24_pairs():
    pairs = COLOCATED_4 + COLOCATED_3 + COLOCATED_6 + COLOCATED_8 + NON_COLOCATED_4 + NON_COLOCATED_8
    assert len(pairs) >= 24


def test_colocated_4_ranks():
    run_distributed(_colocated_cases, 4, COLOCATED_4, BATCHES_8)


# Equal rows per encoder rank within each LLM TP group of GATHER_6[0] (2 and 1): the pattern the
# plan makes all-gathers (plan.Gather); BATCHES_6[0] is one for COLOCATED_3[0] and GATHER_6[1].
EVEN_6 = [([2, 2, 2, 1, 1, 1], SEQ)]


def test_colocated_uneven_dp_3_and_6_ranks():
    """... and the all-gather path: bit-identical to the reference, as the point-to-point one is."""
    run_distributed(_colocated_cases, 3, COLOCATED_3, BATCHES_6 + EVEN_6, False, True)
    run_distributed(_colocated_cases, 6, COLOCATED_6 + GATHER_6, BATCHES_6 + EVEN_6, False, True)


def test_colocated_8_ranks():
    run_distributed(_colocated_cases, 8, COLOCATED_8, BATCHES_8)


REPLICATED_4 = [
    (enc(cp=2, dp=2, replicated=True), llm(cp=2, dp=2)),               # Megatron's homogeneous CP2
    (enc(tp=2, cp=2, replicated=True), llm(tp=2, cp=2)),               # ... with TP
    (enc(tp=2, cp=2, replicated=True), llm(tp=2, cp=2, sp=True)),      # ... with SP
    (enc(cp=4, replicated=True), llm(cp=2, dp=2)),                     # more replicas than LLM CP ranks
    (enc(cp=2, dp=2, replicated=True), llm(tp=4)),                     # an LLM without CP: replica 0
    (enc(cp=2, replicated=True), llm(cp=2, pp=2)),                     # on the LLM's first stage (ranks 0-1)
]


def test_encoder_replicated_over_cp_4_ranks():
    run_distributed(_replicated_cases, 4, REPLICATED_4)


def test_non_colocated_4_ranks():
    run_distributed(_non_colocated_cases, 4, NON_COLOCATED_4, BATCHES_6)


def test_non_colocated_8_ranks():
    run_distributed(_non_colocated_cases, 8, NON_COLOCATED_8, BATCHES_24)


# Items (several per sample) balanced over the encoder's DP ranks: the batch need not split over
# them (4 samples over dp 4 with 1 row in all; 6 samples over dp 4 and 3), ranks without items.
BATCHES_4 = [([3, 0, 1, 2], SEQ), ([0] * 4, SEQ), ([1, 0, 0, 0], SEQ), ([5, 4, 6, 3], SEQ)]
COLOCATED_ITEMS_4 = [COLOCATED_4[i] for i in (0, 1, 6, 9, 11, 16)]


def test_colocated_items_4_ranks():
    run_distributed(_colocated_cases, 4, COLOCATED_ITEMS_4, BATCHES_4, True)


def test_non_colocated_items_4_ranks():
    cases = NON_COLOCATED_4 + [([enc(dp=3)], llm(dp=1, first=3))]
    run_distributed(_non_colocated_cases, 4, cases, BATCHES_6 + [([1, 0, 0, 0, 0, 0], SEQ)], True)


# ---- plan-only properties (no processes) -------------------------------------------------------

def _plans(batch, encoder, llm_layout, world_size):
    return [plan_edge(batch, encoder, llm_layout, r, world_size) for r in range(world_size)]


@pytest.mark.parametrize("encoder, llm_layout", [(e[0], llm) for e, llm in COLOCATED_4 if len(e) == 1])
def test_each_row_reaches_each_consumer_once(encoder, llm_layout):
    """Byte-minimal: the rows received equal rows x consumers per row, and a rank that holds a
    replica of a row it consumes receives it from itself (no bytes leave the rank)."""
    (batch,) = edge_batches([BATCHES_8[0][0]], SEQ, 0)
    plans = _plans(batch, encoder, llm_layout, 4)
    consumers = 1 if llm_layout.sp else llm_layout.tp
    assert sum(int(p.forward.recv_counts.sum()) for p in plans) == batch.num_rows * consumers
    assert sum(int(p.backward.recv_counts.sum()) for p in plans) == batch.num_rows * encoder.tp
    for p in plans:  # what is sent is received
        assert p.forward.send_counts.sum() == sum(q.forward.recv_counts[p.rank] for q in plans)


def test_same_layout_moves_nothing_off_rank():
    (batch,) = edge_batches([BATCHES_8[0][0]], SEQ, 0)
    plans = _plans(batch, enc(tp=2, dp=2), llm(tp=2, dp=2), 4)
    assert all(p.forward.bytes_sent_off_rank(p.rank, 1) == 0 for p in plans)
    assert all(p.backward.bytes_sent_off_rank(p.rank, 1) == 0 for p in plans)


def test_encoder_on_the_first_stage_routes_within_it():
    """An encoder on the LLM's first-stage ranks (layout on_first_stage): its rows and their
    gradients move among those ranks only; the later stages' ranks route nothing."""
    (batch,) = edge_batches([BATCHES_8[0][0]], SEQ, 0)
    plans = _plans(batch, enc(dp=2), llm(dp=2, pp=2), 4)
    for p in plans:
        for routes in (p.forward, p.backward):
            assert not routes.send_counts[2:].any() and not routes.recv_counts[2:].any(), p.rank
            if p.rank >= 2:
                assert not routes.send_counts.any() and not routes.recv_counts.any(), p.rank
    assert sum(p.num_source_rows for p in plans[:2]) == batch.num_rows


@pytest.mark.parametrize("encoder, llm_layout, seq_len, field", [
    (enc(dp=2), llm(dp=2), SEQ, None),
    (enc(dp=3), llm(), SEQ, "dp=3"),
    (enc(), llm(cp=2), 30, "2 x the llm's cp = 4"),
    (enc(), llm(tp=4, sp=True), 30, "tp=4"),
])
def test_plan_rejects_what_it_cannot_serve(encoder, llm_layout, seq_len, field):
    (batch,) = edge_batches([[1, 1, 0, 2]], seq_len, 0)
    world = max(encoder.size, llm_layout.size)
    if field is None:
        plan_edge(batch, encoder, llm_layout, 0, world)
        return
    with pytest.raises(BoundaryError, match=field.replace("*", r"\*")) as error:
        plan_edge(batch, encoder, llm_layout, 0, world)
    assert "\n" not in str(error.value)


def _items(item_dp):
    """Two samples of two 2-row items each at positions 0-3, items assigned to encoder DP ranks."""
    return BoundaryBatch(np.array([4, 4]), np.tile(np.arange(4), 2), SEQ, np.full(4, 2), np.array(item_dp))


@pytest.mark.parametrize("encoder, llm_layout, world, batch, want", [
    (enc(dp=2), llm(tp=2), 2, [4, 4], {0: (0, 1), 1: (0, 1)}),        # the bench's edge: 4 rows each
    (enc(dp=4), llm(tp=2, dp=2), 4, [1, 2, 2, 1, 2, 0, 0, 2],         # a gather per LLM TP group,
     {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}),                   # of 3 and of 2 rows each
    (enc(dp=2), llm(tp=2, pp=2), 4, [3, 3], {0: (0, 1), 1: (0, 1)}),  # the LLM's first stage; none later
    (enc(dp=2), llm(tp=2), 2, [0, 0], {0: (0, 1), 1: (0, 1)}),        # no rows: a gather of none
    (enc(dp=2), llm(tp=2), 2, _items([0, 0, 1, 1]), {0: (0, 1), 1: (0, 1)}),  # items in rank order
    (enc(dp=2), llm(tp=2), 2, _items([1, 0, 0, 1]), None),            # equal, but not in rank order
    (enc(dp=2), llm(tp=2), 2, [3, 5], None),                          # unequal blocks
    (enc(dp=2), llm(tp=2, sp=True), 2, [4, 4], None),                 # SP: each rank takes its part
    (enc(dp=4), llm(tp=2, cp=2), 4, [4, 4, 4, 4], None),              # CP: a group takes others' rows
    (enc(tp=2), llm(tp=2), 2, [4, 4], None),                          # encoder replicas
    (enc(dp=4), llm(tp=2, pp=2), 4, [4, 4, 4, 4], None),              # rows held off the first stage
    (enc(dp=2), llm(tp=2, first=2), 4, [4, 4], None),                 # non-colocated
    (enc(dp=2), llm(dp=2), 2, [4, 4], None),                          # own rows only: no collective
])
def test_plan_recognizes_all_gathers(encoder, llm_layout, world, batch, want):
    """RankPlan.gather (colocated.py's all-gather) exactly where every LLM TP rank takes all rows of
    its group, equal blocks in rank order: its ranks, and each member's rows are its own."""
    if not isinstance(batch, BoundaryBatch):
        (batch,) = edge_batches([batch], SEQ, 0)
    plans = _plans(batch, encoder, llm_layout, world)
    for p in plans:
        group = (want or {}).get(p.rank)
        assert (p.gather and p.gather.ranks) == group, p.rank
        if group:  # member i's rows land at [i * rows, (i + 1) * rows) of each member's LLM side
            assert p.gather.rows == p.num_source_rows and p.num_dest_rows == len(group) * p.gather.rows
            assert not (p.forward.recv_counts[list(group)] - p.gather.rows).any()
            assert p.backward.recv_counts.sum() == p.backward.recv_counts[p.rank] == p.num_source_rows


def test_sending_is_spread_over_encoder_replicas():
    """Encoder TP replicas share the sending: per destination, their row counts differ by <= 1."""
    (batch,) = edge_batches([[7, 3, 5, 1, 0, 6]], SEQ, 0)
    plans = _plans(batch, enc(tp=2), llm(tp=3, dp=2, sp=True, first=2), 8)
    for dst in range(2, 8):
        counts = [plans[r].forward.send_counts[dst] for r in (0, 1)]
        assert abs(counts[0] - counts[1]) <= 1 and sum(counts) == plans[dst].forward.recv_counts.sum()


# ---- the run-based planner equals the row-based one -------------------------------------------

def _random_sizes(rng, ranks: int) -> dict:
    """tp, cp, dp, pp multiplying to `ranks`: each prime factor goes to a random axis."""
    sizes = dict(tp=1, cp=1, dp=1, pp=1)
    for p in (2, 3, 5, 7, 11):
        while ranks % p == 0:
            ranks //= p
            sizes[str(rng.choice(list(sizes)))] *= p
    return sizes


def _random_layouts(rng):
    """An encoder -> LLM pair with random sizes (TP replicas, CP, SP, DP, PP on either side), half
    of them colocated on 1-12 ranks, the others on disjoint ranks."""
    colocated = bool(rng.integers(2))
    enc_ranks = int(rng.integers(1, 13 if colocated else 7))
    llm_sizes = _random_sizes(rng, enc_ranks if colocated else int(rng.integers(1, 9)))
    encoder = ModuleLayout("vision", "encoder", **_random_sizes(rng, enc_ranks))
    llm_layout = ModuleLayout("llm", "llm", **llm_sizes, sp=llm_sizes["tp"] > 1 and bool(rng.integers(2)),
                              first_rank=0 if colocated else enc_ranks)
    return encoder, llm_layout, llm_layout.ranks.stop


def _random_batch(rng, encoder, llm_layout):
    """Samples with 0-3 images of 1-12 tokens each, a few text tokens apart (0: adjacent images
    make one run), or now and then at scattered positions in any order."""
    itemize = rng.random() < 0.5  # several items per sample, any DP rank for each
    b = (llm_layout.dp if itemize else np.lcm(encoder.dp, llm_layout.dp)) * int(rng.integers(1, 4))
    tokens = [rng.integers(1, 13, size=rng.choice(4, p=[0.3, 0.3, 0.2, 0.2])) for _ in range(b)]
    multiple = 2 * llm_layout.cp * llm_layout.tp
    need = max(1 + int(t.sum()) + 3 * len(t) for t in tokens)
    seq = multiple * (-(-need // multiple) + int(rng.integers(0, 3)))
    positions = []
    for t in tokens:
        if rng.random() < 0.15:
            positions.append(rng.permutation(seq)[: t.sum()])
            continue
        gaps = rng.integers(0, 4, size=len(t))
        starts = 1 + np.cumsum(gaps) + np.concatenate([[0], np.cumsum(t)[:-1]]).astype(int)
        positions.append(np.concatenate([[]] + [s + np.arange(n) for s, n in zip(starts, t)]))
    rows = np.array([t.sum() for t in tokens])
    if not itemize:
        return BoundaryBatch(rows, np.concatenate([[]] + positions), seq)
    items = np.concatenate([[]] + tokens).astype(np.int64)
    return BoundaryBatch(rows, np.concatenate([[]] + positions), seq, items,
                         rng.integers(0, encoder.dp, len(items)))


@pytest.mark.parametrize("chunk", range(4))
def test_run_plan_equals_row_plan(chunk):
    """Every rank's routes (counts, index arrays and their dtype) equal the row-by-row planner's,
    and its buffer sizes equal the reference's shares, over random layouts and batches."""
    for case in range(100 * chunk, 100 * (chunk + 1)):
        rng = np.random.default_rng(case)
        encoder, llm_layout, world = _random_layouts(rng)
        batch = _random_batch(rng, encoder, llm_layout)
        where = f"case {case}: {encoder} -> {llm_layout}, rows {batch.rows_per_sample.tolist()}"
        for rank in range(world):
            plan = plan_edge(batch, encoder, llm_layout, rank, world)
            want = row_routes(batch, encoder, llm_layout, rank, world)
            for direction in ("forward", "backward"):
                routes = getattr(plan, direction)
                got = (routes.send_counts, routes.send_index, routes.recv_counts, routes.recv_index)
                for name, a, b in zip(("send_counts", "send_index", "recv_counts", "recv_index"), got,
                                      want[direction]):
                    assert a.dtype == b.dtype and np.array_equal(a, b), f"{where}, rank {rank} {direction} {name}"
            rows = encoder_share(torch.arange(batch.num_rows)[:, None], batch, encoder, rank)
            slots = llm_share(torch.zeros(batch.seq_len, batch.num_samples, 1), llm_layout, rank)
            assert (plan.num_source_rows, plan.num_dest_slots) == (len(rows), len(slots)), where


# ---- ranks that disagree on the metadata stop, all of them, with one line ----------------------

MISMATCH_COUNTS = [1, 0, 2, 1, 3, 1, 0, 2]


def _corrupted(batch: BoundaryBatch, sample: int, more_rows: bool) -> BoundaryBatch:
    """`batch` with one sample's metadata wrong: one more row, or its positions moved by one."""
    rows = batch.rows_per_sample.copy()
    starts = np.concatenate([[0], np.cumsum(rows)])
    mine = batch.positions[starts[sample] : starts[sample + 1]]
    if more_rows:
        rows[sample] += 1
        mine = np.append(mine, np.setdiff1d(np.arange(batch.seq_len), mine)[0])
    else:
        mine = (mine + 1) % batch.seq_len
    positions = np.concatenate([batch.positions[: starts[sample]], mine, batch.positions[starts[sample + 1] :]])
    return BoundaryBatch(rows, positions, batch.seq_len)


def test_disagreement_names_two_ranks_and_the_first_sample():
    (good,) = edge_batches([MISMATCH_COUNTS], SEQ, 0)
    summary = metadata_summary({"vision": good})
    bad = metadata_summary({"vision": _corrupted(good, 3, more_rows=True)})
    line = disagreement([summary, summary, bad, summary], [4, 5, 6, 7])  # the odd one is named
    assert line.startswith("ranks 4 and 6 hold different boundary metadata for edge vision, first at "
                           "sample 3 of the batch: rank 4 has 1 row at positions")
    assert "rank 6 has 2 rows at positions" in line and "\n" not in line
    moved = metadata_summary({"vision": _corrupted(good, 2, more_rows=False)})
    assert "first at sample 2" in disagreement([moved, summary, summary, summary], [0, 1, 2, 3])
    first_six = int(good.rows_per_sample[:6].sum())
    shorter = metadata_summary({"vision": BoundaryBatch(good.rows_per_sample[:6], good.positions[:first_six], SEQ)})
    line = disagreement([summary, shorter], [0, 1])
    assert "first at sample 6" in line and "rank 1 has no such sample" in line
    longer = metadata_summary({"vision": BoundaryBatch(good.rows_per_sample, good.positions, 2 * SEQ)})
    assert f"seq_len {SEQ} on rank 0, {2 * SEQ} on rank 1" in disagreement([summary, longer], [0, 1])
    audio = metadata_summary({"vision": good, "audio": good})
    assert "edge audio: only rank 1 has the edge" in disagreement([summary, audio], [0, 1])


def _step(rank, world_size, encoder, llm_layout, batch):
    """What a schedule does with one batch: check the metadata, then the boundary exchange."""
    check_agreement({"vision": batch}, "cpu")
    plan = plan_edge(batch, encoder, llm_layout, rank, world_size)
    rows = torch.zeros(plan.num_source_rows, HIDDEN)
    if llm_layout.first_rank == 0:  # colocated
        return boundary_exchange(rows, plan)
    return complete([forward_sends(rows, plan), forward_recvs(plan, rows)])[1]


def _mismatch_cases(rank, world_size, out_dir):
    (good,) = edge_batches([MISMATCH_COUNTS], SEQ, 0)
    cases = [  # placement, layouts, the rank given a corrupted batch, its sample, how
        ("colocated", enc(dp=4), llm(tp=2, dp=2), 1, 5, True),
        ("non_colocated", enc(dp=2), llm(tp=2, first=2), 3, 2, False),
    ]
    for placement, encoder, llm_layout, bad_rank, sample, more_rows in cases:
        batch = _corrupted(good, sample, more_rows) if rank == bad_rank else good
        start = time.perf_counter()
        with pytest.raises(BoundaryMismatch) as error:
            _step(rank, world_size, encoder, llm_layout, batch)
        seconds = time.perf_counter() - start
        Path(out_dir, f"{placement}_{rank}.txt").write_text(f"{str(error.value)}\n{seconds}")
        # The group is still usable: with agreeing metadata the same step runs.
        _step(rank, world_size, encoder, llm_layout, good)


def test_ranks_that_disagree_all_stop_with_one_line(tmp_path):
    run_distributed(_mismatch_cases, 4, str(tmp_path))
    for placement, bad_rank, sample in (("colocated", 1, 5), ("non_colocated", 3, 2)):
        lines = [Path(tmp_path, f"{placement}_{r}.txt").read_text().split("\n") for r in range(4)]
        assert len({line for line, _ in lines}) == 1, lines  # the same line on every rank
        line = lines[0][0]
        assert line.startswith(f"ranks 0 and {bad_rank} hold different boundary metadata for edge vision, "
                               f"first at sample {sample} of the batch"), line
        assert max(float(seconds) for _, seconds in lines) < 10, lines


class _ReturnsInput(torch.autograd.Function):
    """What megatron-core's TP all-reduce is to autograd (tensor_parallel.mappings._reduce): a
    custom Function returning its input, which autograd hands on as a view made inside it."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


# How the LLM's embedding [b, s, h] reaches write_rows as [s, b, h]: (micro batch, embedding).
EMBEDDINGS = {
    "copy": (3, lambda text: text.transpose(0, 1).contiguous()),
    # LLM TP without SP at micro batch 1: the transpose is contiguous already, so .contiguous()
    # keeps the view of the all-reduce's output
    "tp_all_reduce_view": (1, lambda text: _ReturnsInput.apply(text * 1).transpose(0, 1).contiguous()),
}


@pytest.mark.parametrize("embedding", list(EMBEDDINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_rows_is_the_masked_merge(dtype, embedding):
    """write_rows (in place, row kernels) against the out-of-place merge it replaced: the same
    input embedding forward; the same gradients for the text embedding (zero where rows were
    written) and for the rows, which may arrive in another dtype; also where the embedding is a
    view autograd forbids writing into."""
    gen = torch.Generator().manual_seed(0)
    b, embed = EMBEDDINGS[embedding]
    seq, h = 21 // b, 5
    at = torch.tensor([1, 2, 9, 10, 11, 20])  # rows of the [seq * b, h] view
    text = torch.randn(b, seq, h, generator=gen).to(dtype).requires_grad_()
    rows = torch.randn(len(at), h, generator=gen).requires_grad_()  # fp32, as a boundary may hold them
    grad = torch.randn(seq, b, h, generator=gen).to(dtype)

    got = write_rows(embed(text), rows, at)
    got.backward(grad)
    got_grads = text.grad, rows.grad
    text.grad = rows.grad = None
    mask = torch.zeros(seq * b, dtype=torch.bool).index_fill_(0, at, True).view(seq, b, 1)
    placed = torch.zeros(seq * b, h).index_copy(0, at, rows).view(seq, b, h).to(dtype)
    want = torch.where(mask, placed, text.transpose(0, 1))
    want.backward(grad)
    assert torch.equal(got, want)
    assert torch.equal(got_grads[0], text.grad) and torch.equal(got_grads[1], rows.grad)
    assert got_grads[1].dtype == torch.float32
