"""Spawn helper: run a function in N gloo processes on a free port (one launch per group of cases,
since process start-up is the expensive part on 2 cores)."""

import datetime
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    # One compute thread per process: the processes of a test already share the cores (2 in CI).
    torch.set_num_threads(1)
    # A collective that never matches fails after the timeout instead of hanging the suite.
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args) -> None:
    """Run fn(rank, world_size, *args) in world_size processes; a failure in any fails the call."""
    mp.start_processes(
        _worker, args=(world_size, _free_port(), fn, args), nprocs=world_size, start_method="spawn"
    )


def _save_result(rank, world_size, fn, out_dir, args):
    torch.save(fn(rank, world_size, *args), Path(out_dir) / f"rank{rank}.pt")


def collect_distributed(fn, world_size: int, out_dir, *args) -> list:
    """run_distributed, returning what fn returned on each rank, in rank order (through out_dir)."""
    run_distributed(_save_result, world_size, fn, str(out_dir), args)
    return [torch.load(Path(out_dir) / f"rank{rank}.pt") for rank in range(world_size)]
