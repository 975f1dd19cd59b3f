"""Boundary communicators on 2 ranks, side by side: raw NCCL, upstream megatron-core, ours.

    torchrun --nproc-per-node 2 benchmarks/bench_boundary.py [--sizes-mb 1 4 16 64 256] [--iters 20]
        [--warmup 5] [--dtype bf16] [--hidden 4096] [--json out.json]

The payload is one rank's encoder output: rows of `hidden` values, every row an image token and
every position of the fused sequence an image row, so each LLM input slot is a boundary row and
upstream's gathered (s*b, h) tensor and our LLM input hold the same rows. Per payload it times:
- raw: all_gather_into_tensor (input = payload); send/recv rank 0 -> rank 1 -> rank 0;
- upstream colocated ColocatedBridgeCommunicator, encoder tp1 dp2 -> LLM tp2 dp1, forward
  (communicate) + backward (autograd), and what it answers for LLM cp2 and tp2+sp;
- upstream non-colocated BridgeCommunicator, encoder rank 0 -> LLM rank 1 and back
  (send_forward, recv_forward, send_backward, recv_backward);
- ours: boundary_exchange forward+backward for LLM tp2, cp2 and tp2+sp, given the LLM's TP group
  as the colocated schedule passes it (tp2: one all-gather, plan.Gather), and for tp2 without it
  (`ours colocated p2p`: point to point, the path the all-gather replaced); forward_sends,
  forward_recvs, backward_sends, backward_recvs for rank 0 -> rank 1 and back.
Without CUDA it runs on gloo as a smoke test: megatron-core's CUDA assumptions are redirected to
the CPU and upstream's NCCL groups are created on gloo (megatron_hetero.patches.cpu).
"""

import argparse
import datetime
import json
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import megatron.core
import numpy as np
import torch
import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.models.mimo.comm.colocated_communicator import ColocatedBridgeCommunicator
from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator

from megatron_hetero.boundary import BoundaryBatch, BoundaryError, RankPlan, boundary_exchange, plan_edge
from megatron_hetero.boundary.non_colocated import backward_recvs, backward_sends, forward_recvs, forward_sends
from megatron_hetero.boundary.transfer import complete, post
from megatron_hetero.parallel.groups import init_distributed
from megatron_hetero.patches import cpu
from megatron_hetero.spec.layout import AXES, ModuleLayout

WORLD_SIZE = 2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MAX_ROWS_PER_SAMPLE = 1024  # 64 MiB per rank is then 8 samples x 1024 rows x 4096 (the anchor's shape)

ENCODER_DP2 = ModuleLayout("vision", "encoder", dp=2)
LLM_TP2 = ModuleLayout("llm", "llm", tp=2)
LLM_CP2 = ModuleLayout("llm", "llm", cp=2)
LLM_TP2_SP = ModuleLayout("llm", "llm", tp=2, sp=True)
ENCODER_RANK0 = ModuleLayout("vision", "encoder", first_rank=0)
LLM_RANK1 = ModuleLayout("llm", "llm", first_rank=1)
COLOCATED_LLMS = (LLM_TP2, LLM_CP2, LLM_TP2_SP)


def describe(layout: ModuleLayout) -> str:
    """tp and dp always (the pair upstream serves), other axes where used."""
    axes = [axis for axis in AXES if axis in ("tp", "dp") or getattr(layout, axis) > 1]
    return " ".join(f"{axis}{getattr(layout, axis)}" for axis in axes) + (" sp" if layout.sp else "")


COLOCATED_PAIR = {llm: f"enc {describe(ENCODER_DP2)} -> llm {describe(llm)}" for llm in COLOCATED_LLMS}
ROUND_TRIP = "rank 0 -> rank 1 -> rank 0"


@dataclass(frozen=True)
class Payload:
    """One encoder rank's output: `samples` samples of `rows_per_sample` rows. The fused sequence
    is the sample's rows (seq_len = rows_per_sample), so each LLM slot receives a row."""

    mib: float
    samples: int
    rows_per_sample: int
    hidden: int
    dtype: torch.dtype

    @property
    def rows(self) -> int:
        return self.samples * self.rows_per_sample

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def batch(self, encoder_dp: int) -> BoundaryBatch:
        """The batch crossing the edge when each of `encoder_dp` encoder ranks holds this payload."""
        samples = self.samples * encoder_dp
        positions = np.tile(np.arange(self.rows_per_sample), samples)
        return BoundaryBatch(np.full(samples, self.rows_per_sample), positions, self.rows_per_sample)

    def encoder_rows(self, rank: int, device: torch.device) -> torch.Tensor:
        """This rank's encoder output [rows, hidden], the same values for every method."""
        generator = torch.Generator(device).manual_seed(rank)
        return torch.randn(self.rows, self.hidden, generator=generator, device=device, dtype=self.dtype)

    def random(self, rows: int, device: torch.device) -> torch.Tensor:
        """[rows, hidden] of this payload's dtype: gradients to route back."""
        return torch.randn(rows, self.hidden, device=device, dtype=self.dtype)


def make_payload(mib: float, hidden: int, dtype: torch.dtype) -> Payload:
    row_bytes = hidden * dtype.itemsize
    nbytes = round(mib * 2**20)
    # 8 rows per sample at least: the fused sequence must split into 2*cp chunks and over tp with sp.
    if nbytes % (8 * row_bytes):
        raise ValueError(
            f"payload {mib} MiB is not a multiple of 8 rows of {row_bytes} bytes; "
            f"use a multiple of {8 * row_bytes / 2**20:g} MiB"
        )
    rows = nbytes // row_bytes
    rows_per_sample = math.gcd(rows, MAX_ROWS_PER_SAMPLE)
    return Payload(mib, rows // rows_per_sample, rows_per_sample, hidden, dtype)


@dataclass
class Bench:
    """One method on one payload: `step` runs one timed iteration; None where it cannot run (`status` says why)."""

    method: str
    layout: str
    off_rank_bytes: int = 0
    step: Callable[[], object] | None = None
    status: str = "ok"


@dataclass
class Row:
    method: str
    layout: str
    payload_mib: float
    off_rank_mb: float | None
    latency_ms: float | None
    gb_per_s: float | None
    status: str


class Env:
    """Rank, device and synchronization of this process."""

    def __init__(self):
        self.rank = dist.get_rank()
        self.nccl = dist.get_backend() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.nccl else torch.device("cpu")

    def sync(self) -> None:
        if self.nccl:
            torch.cuda.synchronize()

    def barrier(self) -> None:
        dist.barrier(device_ids=[self.device.index] if self.nccl else None)


def time_ms(env: Env, step: Callable[[], object], iters: int, warmup: int) -> float:
    """Median over `iters` of the slowest rank's time for one step, each step started together
    (synchronize + barrier) and ended by synchronize."""
    seconds = []
    for _ in range(warmup + iters):
        env.sync()
        env.barrier()
        start = time.perf_counter()
        step()
        env.sync()
        seconds.append(time.perf_counter() - start)
    slowest = torch.tensor(seconds[warmup:], dtype=torch.float64, device=env.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist()) * 1e3


# ---- raw collectives ---------------------------------------------------------------------------


def raw_all_gather(env: Env, payload: Payload) -> Bench:
    rows = payload.encoder_rows(env.rank, env.device)
    gathered = rows.new_empty(WORLD_SIZE * payload.rows, payload.hidden)
    return Bench(
        "raw all_gather", "in payload, out 2x payload", 2 * payload.nbytes,
        lambda: dist.all_gather_into_tensor(gathered, rows),
    )


def raw_round_trip(env: Env, payload: Payload) -> Bench:
    rows = payload.encoder_rows(env.rank, env.device)
    received = torch.empty_like(rows)

    def step():
        if env.rank == 0:
            dist.send(rows, 1)
            dist.recv(received, 1)
        else:
            dist.recv(received, 0)
            dist.send(received, 0)
        return received

    return Bench("raw send/recv", ROUND_TRIP, 2 * payload.nbytes, step)


# ---- upstream megatron-core --------------------------------------------------------------------


def grid(layout: ModuleLayout) -> HyperCommGrid:
    return HyperCommGrid(layout.grid_shape(), list(AXES), rank_offset=layout.first_rank)


class Upstream:
    """Upstream communicators, built once for all payloads (each builds NCCL groups), or the
    message with which upstream refused the layout pair."""

    def __init__(self, dtype: torch.dtype):
        self.colocated: dict[ModuleLayout, ColocatedBridgeCommunicator | str] = {
            # Upstream has no SP input layout: it would accept the pair and deliver the tp2 layout.
            LLM_TP2_SP: "n/a: no sp input layout; accepts tp2 and delivers replicated rows (tp2 row)",
        }
        for llm in (LLM_TP2, LLM_CP2):
            try:
                # (s*b, h) rows, as MimoModel passes its pre-flattened encoder output.
                self.colocated[llm] = ColocatedBridgeCommunicator(
                    grid(ENCODER_DP2), grid(llm), "vision", "llm", dim_mapping={"b": 0, "h": 1}
                )
            except ValueError as error:
                self.colocated[llm] = f"refused: {error}"
        # tensor_ndim=2: the (s*b, h) rows; comm_dtype: receive buffers are allocated in it.
        self.bridge = BridgeCommunicator(
            grid(ENCODER_RANK0), grid(LLM_RANK1), comm_dtype=dtype,
            src_module_name="vision", dest_module_name="llm", tensor_ndim=2,
        )


def upstream_colocated(env: Env, payload: Payload, upstream: Upstream, llm: ModuleLayout) -> Bench:
    bench = Bench("upstream colocated", COLOCATED_PAIR[llm])
    comm = upstream.colocated[llm]
    if isinstance(comm, str):
        bench.status = comm
        return bench
    rows = payload.encoder_rows(env.rank, env.device).requires_grad_()
    grad_gathered = payload.random(WORLD_SIZE * payload.rows, env.device)

    def step():
        gathered = comm.communicate(rows)
        (grad_rows,) = torch.autograd.grad(gathered, rows, grad_gathered)
        return gathered, grad_rows

    # Fan-in: the forward all-gathers (payload out, payload in); the backward narrows locally.
    bench.off_rank_bytes, bench.step = 2 * payload.nbytes, step
    return bench


def upstream_round_trip(env: Env, payload: Payload, upstream: Upstream) -> Bench:
    bridge = upstream.bridge
    rows = payload.encoder_rows(env.rank, env.device)
    grad_rows = payload.random(payload.rows, env.device)

    def step():
        if env.rank == 0:
            bridge.send_forward(rows)
            return bridge.recv_backward()
        received = bridge.recv_forward()
        bridge.send_backward(grad_rows)
        return received

    # Shape messages (2 int64 each way) are left out of the bytes.
    return Bench("upstream bridge", ROUND_TRIP, 2 * payload.nbytes, step)


# ---- ours --------------------------------------------------------------------------------------


def off_rank_bytes(plan: RankPlan, row_bytes: int) -> int:
    """Bytes that `plan.rank` sends to and receives from other ranks, forward and backward."""
    rows = 0
    for routes in (plan.forward, plan.backward):
        for counts in (routes.send_counts, routes.recv_counts):
            rows += int(counts.sum() - counts[plan.rank])
    return rows * row_bytes


def plan_all_ranks(batch: BoundaryBatch, encoder: ModuleLayout, llm: ModuleLayout) -> list[RankPlan]:
    """Every rank's plan (pure), for the busiest rank's bytes; raises BoundaryError on all ranks alike."""
    return [plan_edge(batch, encoder, llm, rank, WORLD_SIZE) for rank in range(WORLD_SIZE)]


def ours_colocated(env: Env, payload: Payload, llm: ModuleLayout, tp_group) -> Bench:
    """`tp_group`: this rank's LLM TP group (the all-gather where the plan is one); None: point to point."""
    bench = Bench("ours colocated p2p" if tp_group is None else "ours colocated", COLOCATED_PAIR[llm])
    try:
        plans = plan_all_ranks(payload.batch(ENCODER_DP2.dp), ENCODER_DP2, llm)
    except BoundaryError as error:
        bench.status = f"ours: not supported yet: {error}"
        return bench
    plan = plans[env.rank]
    rows = payload.encoder_rows(env.rank, env.device).requires_grad_()
    grad_slots = payload.random(plan.num_dest_rows, env.device)

    def step():
        slots = boundary_exchange(rows, plan, llm_tp_group=tp_group)
        (grad_rows,) = torch.autograd.grad(slots, rows, grad_slots)
        return slots, grad_rows

    bench.off_rank_bytes = max(off_rank_bytes(p, payload.row_bytes) for p in plans)
    bench.step = step
    return bench


def ours_round_trip(env: Env, payload: Payload) -> Bench:
    plans = plan_all_ranks(payload.batch(ENCODER_RANK0.dp), ENCODER_RANK0, LLM_RANK1)
    plan = plans[env.rank]
    rows = payload.encoder_rows(env.rank, env.device)
    grad_slots = payload.random(plan.num_dest_rows, env.device)

    def step():
        if env.rank == 0:  # the gradients' receive is posted while the rows are in flight
            grads = backward_recvs(plan, like=rows)
            for work in post([forward_sends(rows, plan)]) + post([grads]):
                work.wait()
            return grads.result()
        (slots,) = complete([forward_recvs(plan, like=grad_slots)])
        complete([backward_sends(grad_slots, plan)])
        return slots

    return Bench("ours p2p", ROUND_TRIP, max(off_rank_bytes(p, payload.row_bytes) for p in plans), step)


def llm_tp_groups() -> dict:
    """Collective: each colocated LLM layout's TP group of this rank, as the runtime's module groups
    hold it (groups.build_module_groups, the group colocated.py passes to boundary_exchange)."""
    return {llm: grid(llm).create_pg("tp") for llm in COLOCATED_LLMS}


def benches(env: Env, payload: Payload, upstream: Upstream, tp_groups: dict):
    """The methods for one payload, built one at a time so that only one holds buffers."""
    yield lambda: raw_all_gather(env, payload)
    for llm in COLOCATED_LLMS:
        yield lambda llm=llm: upstream_colocated(env, payload, upstream, llm)
        yield lambda llm=llm: ours_colocated(env, payload, llm, tp_groups[llm])
    yield lambda: ours_colocated(env, payload, LLM_TP2, None)
    yield lambda: raw_round_trip(env, payload)
    yield lambda: upstream_round_trip(env, payload, upstream)
    yield lambda: ours_round_trip(env, payload)


def measure(env: Env, bench: Bench, payload: Payload, iters: int, warmup: int) -> Row:
    if bench.step is None:
        return Row(bench.method, bench.layout, payload.mib, None, None, None, bench.status)
    ms = time_ms(env, bench.step, iters, warmup)
    gb_per_s = bench.off_rank_bytes / (ms * 1e-3) / 1e9
    return Row(bench.method, bench.layout, payload.mib, bench.off_rank_bytes / 1e6, ms, gb_per_s, bench.status)


# ---- report ------------------------------------------------------------------------------------

COLUMNS = f"{'method':<19} {'layout':<30} {'MiB/rank':>8} {'off-rank MB':>11} {'ms':>8} {'GB/s':>7}  status"


def format_row(row: Row) -> str:
    def number(value, spec):
        width = spec.split(".")[0]
        return format("-", f">{width}") if value is None else format(value, spec)

    return (
        f"{row.method:<19} {row.layout:<30} {row.payload_mib:>8g} {number(row.off_rank_mb, '11.1f')} "
        f"{number(row.latency_ms, '8.3f')} {number(row.gb_per_s, '7.1f')}  {row.status}"
    )


def header(env: Env, args) -> dict:
    if env.nccl:
        device = f"{WORLD_SIZE} x {torch.cuda.get_device_name(env.device)}"
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        device = "CPU (gloo smoke test: upstream runs with CPU buffers and gloo groups)"
        nccl = "-"
    command = " ".join(["torchrun", f"--nproc-per-node {WORLD_SIZE}", *map(shlex.quote, sys.argv)])
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": device,
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
        "nccl": nccl,
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "-"),
        "command": command,
        "rows": f"hidden {args.hidden} x {args.dtype} = {args.hidden * DTYPES[args.dtype].itemsize} bytes",
        "iters": args.iters,
        "warmup": args.warmup,
    }


DEFINITIONS = """\
# MiB/rank: one rank's encoder output (the payload), 2^20 bytes.
# off-rank MB: bytes one rank sends to plus receives from the other rank in one step (10^6 bytes),
#   the busier rank; a colocated step is forward+backward, a rank 0 -> 1 -> 0 step a round trip.
# ms: median over iters of the slower rank's step time, each step between cuda synchronize+barrier
#   and cuda synchronize. GB/s: off-rank bytes / ms (10^9 bytes/s), send and receive counted both:
#   for these 2-rank patterns half of it is the one-direction link rate."""


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64, 256],
                        help="payloads: encoder output per rank in MiB")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--hidden", type=int, default=4096, help="LLM hidden size: values per row")
    parser.add_argument("--backend", choices=["nccl", "gloo"],
                        help="default: nccl with CUDA, else gloo")
    parser.add_argument("--json", help="also write the header and rows to this JSON file")
    args = parser.parse_args(argv)
    try:
        args.payloads = [make_payload(mib, args.hidden, DTYPES[args.dtype]) for mib in args.sizes_mb]
    except ValueError as error:
        parser.error(str(error))
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be 1 or more and --warmup 0 or more")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    owns_process_group = not dist.is_initialized()
    if owns_process_group:
        # A hang fails in minutes, well inside the time a GPU run has.
        init_distributed(args.backend, timeout=datetime.timedelta(minutes=3))
    if dist.get_world_size() != WORLD_SIZE:
        raise SystemExit(f"error: run on {WORLD_SIZE} ranks (torchrun --nproc-per-node {WORLD_SIZE})")
    env = Env()
    if not env.nccl:
        cpu.apply()
    say = print if env.rank == 0 else (lambda *a, **kw: None)

    info = header(env, args)
    say("# boundary communicators, 2 ranks: raw vs upstream megatron-core vs ours")
    for key, value in info.items():
        say(f"# {key}: {value}")
    say(DEFINITIONS)
    upstream = Upstream(DTYPES[args.dtype])
    tp_groups = llm_tp_groups()
    say(COLUMNS, flush=True)
    rows = []
    for payload in args.payloads:
        for build in benches(env, payload, upstream, tp_groups):
            row = measure(env, build(), payload, args.iters, args.warmup)
            rows.append(row)
            say(format_row(row), flush=True)
    if args.json and env.rank == 0:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"header": info, "rows": [asdict(row) for row in rows]}, f, indent=1)
    env.barrier()
    if owns_process_group:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
