"""GPU memory held outside PyTorch's allocator by a layout's process groups, eager and lazy.

Why: W6's vision DP2 -> LLM TP2+SP recomputing 10 of 12 layers ran out of memory on an 80 GB H100
with at most 68.2 GiB allocated of 79.2 (docs/runs/benchmarks.md, docs/runs/gpu2/w6_h100_10steps):
~10 GiB sat outside the peak allocation. This measures, per rank, the device memory outside
PyTorch's allocator (in use by the process less the allocator's reserved memory) after start-up,
after building the layout's groups (`runtime.context.build_run`), and after one all-reduce on each
of them, with the default group bound to this rank's GPU (torch then makes every later group's
communicator at once) or not (`--lazy`, as megatron.training starts: each at its first
collective). Measured on 2 H100s (docs/runs/benchmarks.md, docs/runs/gpu2/w6_l8_nccl to
w6_shared_groups): 1.4 GiB at start-up; 11.4 GiB after the all-reduces with a group per
megatron-core field (24 groups, 9 of the same two ranks), either way; 2.8 GiB since groups.py
shares communicators (3 groups).

Usage (GPUs only):
    torchrun --nproc-per-node 2 benchmarks/gpu_nccl_memory.py \
        --hetero-layout examples/layouts/gpu2_colocated_sp.yaml [--lazy]
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from megatron_hetero.parallel.context import build_run
from megatron_hetero.parallel.groups import init_distributed
from megatron_hetero.runtime.failures import GIB
from megatron_hetero.spec.layout import load_layout


def outside_allocator_gib() -> float:
    """This GPU's memory in use less what PyTorch's allocator reserved (the other processes' share
    is none here: one rank per GPU)."""
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / GIB


def member_groups() -> list:
    """Every NCCL process group this rank belongs to but the default one (torch's registry; gloo
    groups, which some Megatron options add, hold no GPU memory)."""
    default = dist.distributed_c10d._get_default_group()
    return [group for group in dist.distributed_c10d._world.pg_map
            if group is not default and dist.get_backend(group) == "nccl"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hetero-layout", required=True)
    parser.add_argument("--lazy", action="store_true", help="the default group without a bound device")
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: gpu_nccl_memory.py measures GPU memory: run it on GPUs", file=sys.stderr)
        return 2
    if opts.lazy:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    else:
        init_distributed()
    dist.barrier()
    torch.cuda.synchronize()
    figures = {"start-up": outside_allocator_gib()}
    build_run(load_layout(opts.hetero_layout, dist.get_world_size()))
    found = member_groups()
    torch.cuda.synchronize()
    figures["groups built"] = outside_allocator_gib()
    one = torch.ones(1, device="cuda")
    for group in found:
        dist.all_reduce(one, group=group)
    torch.cuda.synchronize()
    figures["one all-reduce on each"] = outside_allocator_gib()
    record = {"rank": dist.get_rank(), "lazy": opts.lazy, "groups": len(found),
              "sizes": sorted(dist.get_world_size(g) for g in found), "device": torch.cuda.get_device_name(),
              "outside_allocator_gib": {k: round(v, 3) for k, v in figures.items()}}
    print(json.dumps(record), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
