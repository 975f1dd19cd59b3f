"""The colocated boundary's local part on one device: what it moves and how many kernels it runs.

    torchrun --nproc-per-node 1 benchmarks/bench_boundary_local.py [--images 16] [--tokens-per-image 729]
        [--text 8] [--micro-batch 1] [--hidden 4096] [--dtype bf16] [--iters 50] [--json out.json]

One rank holds the encoder and the LLM (every row is delivered to itself). Per microbatch of
`--micro-batch` samples, each with `--images` images of `--tokens-per-image` rows separated by
`--text` text tokens, three variants forward and backward:
- `text`: the LLM's input embedding alone (a copy of a sequence-first tensor standing in for it);
- `direct`: the same plus the boundary as the runtime runs it: boundary_exchange (rows -> the LLM
  side's rows) written into the embedding by one row copy (boundary.write_rows, models/vlm.py);
- `merge`: the same plus the boundary as it ran before: a zero-filled slot tensor for the whole
  sequence, the rows scattered into it, and a torch.where merge with the slot mask.
The boundary's cost is a variant's time minus `text`'s. It reports, per variant and direction, the
milliseconds and the device kernels launched (torch.profiler), the bytes the rows themselves occupy
(the minimum any re-layout reads and writes once), the device's copy rate on a tensor of that size
(a clone: the reachable HBM figure), and the CPU time of one boundary call with the device idle
(the per-call Python overhead). Without CUDA it runs on the CPU.
"""

import argparse
import json
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from megatron_hetero.boundary import BoundaryBatch, boundary_exchange, filled_slots, input_rows, plan_edge, write_rows
from megatron_hetero.parallel.groups import init_distributed
from megatron_hetero.spec.layout import ModuleLayout

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--tokens-per-image", type=int, default=729)
    parser.add_argument("--text", type=int, default=8, help="text tokens before each image")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def make_batch(args) -> BoundaryBatch:
    period = args.text + args.tokens_per_image
    positions = np.concatenate([i * period + args.text + np.arange(args.tokens_per_image)
                                for i in range(args.images)])
    seq = args.images * period + args.text
    return BoundaryBatch(np.full(args.micro_batch, len(positions)), np.tile(positions, args.micro_batch), seq)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, device, iters) -> float:
    """Milliseconds per call, after one warm-up call."""
    step()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync(device)
    return (time.perf_counter() - start) / iters * 1e3


def kernels(step, device) -> int:
    """Device kernels (CPU ops without CUDA) one call launches."""
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        step()
        sync(device)
    if device.type == "cuda":
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in prof.events() if e.cpu_parent is None)


def _boundary_share(results: dict, rows, plan, device, iters: int) -> None:
    """The boundary's own share of each variant (minus the text-only step), a plain copy of the rows
    to compare with, the CPU time of one call, and the rows' throughput."""
    for name in ("direct", "merge"):
        for way in ("forward", "backward"):
            results[f"{name}_boundary_{way}_ms"] = results[f"{name}_{way}_ms"] - results[f"text_{way}_ms"]
            kernels_added = results[f"{name}_{way}_kernels"] - results[f"text_{way}_kernels"]
            results[f"{name}_boundary_{way}_kernels"] = kernels_added
    copy = rows.detach().clone()
    results["clone_ms"] = timed(lambda: copy.clone(), device, iters)
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        boundary_exchange(rows, plan)  # CPU time to enqueue one call (the device's work not waited for)
    results["forward_call_cpu_ms"] = (time.perf_counter() - start) * 1e3
    for key in ("direct_boundary_forward", "direct_boundary_backward", "clone"):
        # Read once + written once: the rows' bytes twice.
        ms = results[f"{key}_ms"]
        results[f"{key}_rows_GBps"] = 2 * results["row_bytes"] / (ms * 1e-3) / 1e9 if ms > 0 else None


def main(argv=None) -> int:
    args = parse_args(argv)
    device = init_distributed()
    dtype = DTYPES[args.dtype]
    batch = make_batch(args)
    plan = plan_edge(batch, ModuleLayout("vision", "encoder"), ModuleLayout("llm", "llm"), 0, 1)
    b, seq, h = args.micro_batch, batch.seq_len, args.hidden
    rows = torch.randn(batch.num_rows, h, device=device, dtype=dtype, requires_grad=True)
    embedding = torch.randn(seq, b, h, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(seq, b, h, device=device, dtype=dtype)
    at, filled = input_rows(plan, b, device), filled_slots(plan, device)
    mask = torch.zeros(b * seq, dtype=torch.bool, device=device).index_fill_(0, filled, True)
    mask = mask.view(b, seq).t().contiguous()[..., None]

    def text():  # the embedding's output: a fresh tensor, its backward a pass-through
        return embedding.clone()

    def direct():
        return write_rows(text(), boundary_exchange(rows, plan), at)  # as models/vlm.py

    def merge():
        slots = rows.new_zeros(b * seq, h).index_copy(0, filled, boundary_exchange(rows, plan))
        return torch.where(mask, slots.view(b, seq, h).transpose(0, 1), text())

    results = dict(args=vars(args), device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   rows=batch.num_rows, slots=seq * b, row_bytes=batch.num_rows * h * rows.element_size())
    for name, variant in (("text", text), ("direct", direct), ("merge", merge)):
        state = {}

        def forward():
            state["out"] = variant()

        def backward():
            rows.grad = embedding.grad = None
            state["out"].backward(grad_out, retain_graph=True)

        forward()
        results[f"{name}_forward_ms"] = timed(forward, device, args.iters)
        results[f"{name}_backward_ms"] = timed(backward, device, args.iters)
        results[f"{name}_forward_kernels"] = kernels(forward, device)
        results[f"{name}_backward_kernels"] = kernels(backward, device)
    _boundary_share(results, rows, plan, device, args.iters)
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
