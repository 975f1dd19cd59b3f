"""Boundary exactness: forward rows and routed gradients equal a single-process re-layout, bit for bit."""

import numpy as np
import pytest
import torch

from megatron_hetero.boundary import BoundaryBatch, BoundaryError, boundary_exchange, plan_edge, slot_mask
from megatron_hetero.layout import ModuleLayout
from tests.distributed import run_distributed

HIDDEN = 8


def _batch(rows_per_sample, seq_len, seed):
    """Rows of each sample at distinct random positions of its fused sequence."""
    rng = np.random.default_rng(seed)
    positions = [np.sort(rng.choice(seq_len, n, replace=False)) for n in rows_per_sample]
    return BoundaryBatch(np.array(rows_per_sample), np.concatenate([[]] + positions), seq_len)


def _reference_forward(rows, batch):
    """Single process: the whole batch's LLM input [seq, B, h] with every row at its address."""
    full = torch.zeros(batch.seq_len, batch.num_samples, rows.shape[1], dtype=rows.dtype)
    samples = np.repeat(np.arange(batch.num_samples), batch.rows_per_sample)
    full[torch.as_tensor(batch.positions), torch.as_tensor(samples)] = rows
    return full


def _reference_backward(grad_full, batch):
    """Single process: each row's gradient is the input gradient at its address."""
    samples = np.repeat(np.arange(batch.num_samples), batch.rows_per_sample)
    return grad_full[torch.as_tensor(batch.positions), torch.as_tensor(samples)]


def _module_slice(module, coords, batch, rows_per_dp_of=None):
    per_dp = batch.num_samples // module.dp
    return slice(coords["dp"] * per_dp, (coords["dp"] + 1) * per_dp)


def _check_case(rank, world_size, encoder, llm, batch, dtype):
    gen = torch.Generator().manual_seed(1)
    rows_all = torch.randn(batch.num_rows, HIDDEN, generator=gen).to(dtype)
    grad_full = torch.randn(batch.seq_len, batch.num_samples, HIDDEN, generator=gen).to(dtype)
    plan = plan_edge(batch, encoder, llm, rank, world_size)

    enc = encoder.coords(rank)
    row_start = np.concatenate([[0], np.cumsum(batch.rows_per_sample)])
    if enc:
        samples = _module_slice(encoder, enc, batch)
        local_rows = rows_all[row_start[samples.start] : row_start[samples.stop]].clone()
    else:
        local_rows = rows_all[:0].clone()
    local_rows.requires_grad_(True)

    out = boundary_exchange(local_rows, plan)
    llm_coords = llm.coords(rank)
    if llm_coords:
        samples = _module_slice(llm, llm_coords, batch)
        expected = _reference_forward(rows_all, batch)[:, samples].reshape(-1, HIDDEN)
        assert torch.equal(out, expected), f"rank {rank}: forward rows differ"
        mask_expected = _reference_forward(torch.ones(batch.num_rows, 1), batch)[:, samples]
        assert torch.equal(slot_mask(plan, "cpu"), mask_expected.reshape(-1) > 0)
        # Every LLM TP replica holds the same full input gradient, as Megatron's TP backward leaves it.
        grad_out = grad_full[:, samples].reshape(-1, HIDDEN)
    else:
        assert out.shape == (0, HIDDEN)
        grad_out = torch.zeros_like(out)
    out.backward(grad_out)
    if enc:
        samples = _module_slice(encoder, enc, batch)
        expected = _reference_backward(grad_full, batch)[row_start[samples.start] : row_start[samples.stop]]
        assert torch.equal(local_rows.grad, expected), f"rank {rank}: routed gradients differ"


# (encoder tp, dp) -> (llm tp, dp), colocated on 4 ranks: DP fan-in, fan-out, equal, TP both sides.
COLOCATED_4 = [((1, 4), (2, 2)), ((2, 2), (1, 4)), ((1, 4), (4, 1)), ((4, 1), (1, 4)),
               ((2, 2), (2, 2)), ((1, 4), (1, 4)), ((4, 1), (2, 2)), ((2, 2), (4, 1))]
BATCHES = [([1, 0, 2, 1, 3, 1, 0, 2], 16), ([0] * 8, 6), ([3, 3, 3, 3, 0, 0, 0, 0], 12)]


def _colocated_cases(rank, world_size, pairs, batches):
    for (etp, edp), (ltp, ldp) in pairs:
        encoder = ModuleLayout("vision", "encoder", tp=etp, dp=edp)
        llm = ModuleLayout("llm", "llm", tp=ltp, dp=ldp)
        for seed, (rows, seq_len) in enumerate(batches):
            for dtype in (torch.float32, torch.bfloat16):
                _check_case(rank, world_size, encoder, llm, _batch(rows, seq_len, seed), dtype)


def test_colocated_tp_dp_exact_4_ranks():
    run_distributed(_colocated_cases, 4, COLOCATED_4, BATCHES)


def test_colocated_uneven_dp_exact_3_ranks():
    pairs = [((1, 3), (3, 1)), ((3, 1), (1, 3)), ((1, 3), (1, 3))]
    run_distributed(_colocated_cases, 3, pairs, [([2, 0, 1, 1, 2, 0], 9), ([0] * 6, 4)])


def test_plan_rejects_batch_not_divisible_by_dp():
    batch = _batch([1, 1, 1], 4, 0)
    with pytest.raises(BoundaryError, match="dp=2"):
        plan_edge(batch, ModuleLayout("vision", "encoder", dp=2), ModuleLayout("llm", "llm", dp=2), 0, 2)


def test_plan_forward_moves_each_row_once_per_consumer():
    """Bytes: each row reaches each consuming LLM rank exactly once, and a colocated rank that
    holds a row it consumes keeps it local."""
    batch = _batch([2, 1, 0, 3], 8, 3)
    encoder, llm = ModuleLayout("vision", "encoder", tp=2, dp=2), ModuleLayout("llm", "llm", tp=2, dp=2)
    plans = [plan_edge(batch, encoder, llm, r, 4) for r in range(4)]
    received = sum(int(p.forward.recv_counts.sum()) for p in plans)
    assert received == batch.num_rows * llm.tp
    # Same layouts on the same ranks: every row is already where it is consumed.
    assert all(p.forward.bytes_sent_off_rank(p.rank, 1) == 0 for p in plans)
