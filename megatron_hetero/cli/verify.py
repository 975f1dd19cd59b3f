"""Verify a layout's boundaries on your own cluster before a long job.

    torchrun --nproc-per-node N --no-python megatron-hetero verify LAYOUT.yaml \
        [--images-per-sample 1 0 2] [--tokens-per-image 64] [--global-batch-size B] [--dtype bf16]

Pushes patterned tensors through every edge forward and backward (colocated: all-to-all;
non-colocated: point-to-point), checks every element on every rank against a single-process
re-layout, and prints per edge: bytes moved off-rank (busiest rank and total), the planned minimum,
what a whole-batch gather would move, time and GB/s. Exits 1 on any mismatch, 2 on bad input.
Works on gloo (CPU) and NCCL (GPUs).
"""

import argparse
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from megatron_hetero.boundary import BoundaryBatch, BoundaryError, assign_items, boundary_exchange, plan_edge
from megatron_hetero.boundary.non_colocated import backward_recvs, backward_sends, forward_recvs, forward_sends
from megatron_hetero.boundary.reference import encoder_share, llm_share, row_samples
from megatron_hetero.boundary.transfer import complete
from megatron_hetero.parallel.groups import init_distributed
from megatron_hetero.spec.layout import HeteroLayout, LayoutError, load_layout


def parse_args(argv=None, prog=None):
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], fromfile_prefix_chars="@")
    parser.add_argument("layout", help="the layout YAML file")
    parser.add_argument("--images-per-sample", type=int, nargs="+", default=[1, 0, 2, 1],
                        help="image counts, cycled over the samples of the batch (0 allowed)")
    parser.add_argument("--tokens-per-image", type=int, default=16, help="rows an image sends to the LLM (default 16)")
    parser.add_argument("--global-batch-size", type=int, default=None,
                        help="default: the smallest multiple of the llm's dp that is >= 4")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="fused sequence length (default: what the images need, padded)")
    parser.add_argument("--hidden-size", type=int, default=256, help="row width (default 256)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="row dtype (default fp32)")
    parser.add_argument("--iters", type=int, default=5, help="timed repetitions after the check")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the layout and plan every rank's boundaries for WORLD_SIZE ranks "
                             "in this one process; nothing is exchanged")
    return parser.parse_args(argv)


def make_batches(layout: HeteroLayout, args) -> list[BoundaryBatch]:
    """One BoundaryBatch per edge: each sample's images (edge by edge) follow one prefix token; each
    image an item, assigned to the edge's encoder DP ranks as the runtime assigns them (by cost)."""
    llm_dp = layout.llm.dp
    batch_size = args.global_batch_size or llm_dp * math.ceil(4 / llm_dp)
    if batch_size % llm_dp:
        raise BoundaryError(f"--global-batch-size {batch_size} is not divisible by module {layout.llm.name}'s "
                            f"dp={llm_dp}; use a multiple of {llm_dp}")
    images = np.resize(np.array(args.images_per_sample), batch_size)
    rows = images * args.tokens_per_image
    edges = len(layout.edges)
    need = 1 + edges * int(rows.max(initial=0))
    llm = layout.llm
    multiple = (2 * llm.cp if llm.cp > 1 else 1) * (llm.tp if llm.sp else 1)
    seq_len = args.seq_length or -(-need // multiple) * multiple
    if seq_len < need:
        raise BoundaryError(f"--seq-length {seq_len} is shorter than the {need} tokens the images need")
    tokens = np.full(int(images.sum()), args.tokens_per_image)
    return [BoundaryBatch(rows, np.concatenate([[]] + [1 + e * n + np.arange(n) for n in rows]), seq_len, tokens,
                          assign_items(tokens, args.hidden_size, layout.module(edge.src).dp))
            for e, edge in enumerate(layout.edges)]


def pattern(addresses: torch.Tensor, hidden: int, salt: int, dtype) -> torch.Tensor:
    """Distinct small integers per (address, column): exact in bf16, so equality is meaningful."""
    cols = torch.arange(hidden, device=addresses.device)
    return ((addresses[:, None] * (131 + salt) + cols * (7 + salt)) % 251 - 125).to(dtype)


def slot_addresses(batch: BoundaryBatch, layout, rank, device) -> torch.Tensor:
    """Each of this rank's LLM input slots' address (position * B + sample), by Megatron's slicing."""
    full = torch.arange(batch.seq_len * batch.num_samples, device=device).view(batch.seq_len, -1, 1)
    return llm_share(full, layout, rank).view(-1)


def all_row_addresses(batch: BoundaryBatch, device) -> torch.Tensor:
    """Every row's address (position * B + sample), in row order."""
    return torch.as_tensor(batch.positions, device=device) * batch.num_samples + row_samples(batch).to(device)


class EdgeRun:
    """One edge on this rank: its plan, patterned inputs and expected outputs."""

    def __init__(self, layout, encoder, batch, rank, world_size, hidden, dtype, device):
        self.colocated = layout.placement == "colocated"
        self.plan = plan_edge(batch, encoder, layout.llm, rank, world_size)
        addresses = all_row_addresses(batch, device)
        rows = encoder_share(addresses[:, None], batch, encoder, rank).view(-1)
        slots = slot_addresses(batch, layout.llm, rank, device)
        image = torch.zeros(batch.seq_len * batch.num_samples, dtype=torch.bool, device=device)
        image[addresses] = True
        slots = slots[image[slots]]  # the LLM side holds the rows of the slots an image fills
        self.rows = pattern(rows, hidden, 0, dtype)
        self.want_slots = pattern(slots, hidden, 0, dtype)
        self.grad_slots = pattern(slots, hidden, 1, dtype)
        self.want_grad = pattern(rows, hidden, 1, dtype)

    def run(self):
        """Forward and backward once; returns (slots, row gradients) of this rank."""
        if self.colocated:
            rows = self.rows.clone().requires_grad_(True)
            slots = boundary_exchange(rows, self.plan)
            slots.backward(self.grad_slots)
            return slots.detach(), rows.grad
        # A rank is one side of the edge: the other side's transfer has no ops, its result [0, h].
        plan, like = self.plan, self.rows
        _, slots = complete([forward_sends(self.rows, plan), forward_recvs(plan, like)])
        _, grad = complete([backward_sends(self.grad_slots, plan), backward_recvs(plan, like)])
        return slots, grad


def planned_minimum(batch, encoder, llm, world_size) -> int:
    """Rows that must cross ranks, both directions, from the layouts alone (not the plan): a row
    goes to each rank that consumes it without holding it, and its gradient to each rank that
    holds it without consuming it."""
    ids = torch.arange(batch.num_rows)
    full = torch.full((batch.seq_len, batch.num_samples, 1), -1)
    full[torch.as_tensor(batch.positions), row_samples(batch)] = ids[:, None]
    rows = 0
    for r in range(world_size):
        held = encoder_share(ids[:, None], batch, encoder, r).view(-1)
        consumed = llm_share(full, llm, r).view(-1)
        consumed = consumed[consumed >= 0]
        rows += int((~torch.isin(consumed, held)).sum()) + int((~torch.isin(held, consumed)).sum())
    return rows


def _check_edge(layout, edge, batch, rank: int, world_size: int, args, dtype, device) -> tuple:
    """One edge's exchange forward and backward, checked against the single-process re-layout and
    timed: (edge, batch, encoder, busiest rank's off-rank bytes, all ranks', seconds, mismatch)."""
    cuda = device.type == "cuda"
    row_bytes = args.hidden_size * torch.finfo(dtype).bits // 8
    encoder = layout.module(edge.src)
    run = EdgeRun(layout, encoder, batch, rank, world_size, args.hidden_size, dtype, device)
    slots, grad = run.run()
    ok = torch.equal(slots, run.want_slots) and torch.equal(grad, run.want_grad)
    times = []
    for _ in range(args.iters):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        run.run()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    moved = sum(routes.bytes_sent_off_rank(rank, row_bytes) for routes in (run.plan.forward, run.plan.backward))
    stats = torch.tensor([moved, float(np.median(times)) if times else 0.0, 0.0 if ok else 1.0],
                         dtype=torch.float64, device=device)
    total = stats.clone()
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    dist.all_reduce(total)
    return edge, batch, encoder, stats[0].item(), total[0].item(), stats[1].item(), stats[2].item()


def main(argv=None, prog=None) -> int:
    args = parse_args(argv, prog)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    try:
        layout = load_layout(args.layout, world_size)
        batches = make_batches(layout, args)
        for (edge, batch) in zip(layout.edges, batches):
            for r in range(world_size) if args.dry_run else [rank]:
                plan_edge(batch, layout.module(edge.src), layout.llm, r, world_size)
    except (LayoutError, BoundaryError) as error:
        if rank == 0:
            print(f"error: {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(layout.rank_map())
        print(f"layout and every rank's boundary plans ok on {world_size} ranks (dry run: nothing exchanged)")
        return 0

    device = init_distributed()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    row_bytes = args.hidden_size * torch.finfo(dtype).bits // 8
    dist.barrier()  # the first collective on the world group includes every rank (NCCL P2P needs it)

    report = [_check_edge(layout, edge, batch, rank, world_size, args, dtype, device)
              for edge, batch in zip(layout.edges, batches)]
    failures = sum(int(entry[-1]) for entry in report)

    if rank == 0:
        print(layout.rank_map())
        print(f"dtype {args.dtype}, hidden {args.hidden_size}, {args.tokens_per_image} tokens per image, "
              f"backend {dist.get_backend()}")
        for edge, batch, encoder, busiest, total, seconds, bad in report:
            minimum = planned_minimum(batch, encoder, layout.llm, world_size) * row_bytes
            # A whole-batch gather delivers every row to every LLM rank, forward, and back.
            gather = 2 * batch.num_rows * layout.llm.size * row_bytes
            ratio = f"{gather / total:.1f}x" if total else "n/a"
            rate = f"{busiest / seconds / 1e9:.2f}" if seconds else "n/a"
            print(f"edge {edge}: {'MISMATCH' if bad else 'ok'} | {batch.num_samples} samples, "
                  f"{batch.num_rows} rows, seq {batch.seq_len} | off-rank bytes: busiest rank "
                  f"{busiest / 1e6:.3f} MB, all ranks {total / 1e6:.3f} MB, planned minimum "
                  f"{minimum / 1e6:.3f} MB | whole-batch gather would move {gather / 1e6:.3f} MB "
                  f"({ratio}) | fwd+bwd {1e3 * seconds:.3f} ms, {rate} GB/s per busiest rank")
        print("all edges exact" if not failures else f"{failures} edge(s) MISMATCH")
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
