"""Encoder load balancing, measured: per-DP-rank vision encoder forward + backward time on a skewed
global batch, each rank's images as Megatron's data parallelism assigns them (contiguous slices of
the samples: "before") and as the boundary's balancer does (boundary.assign_items: "after").

    torchrun --nproc-per-node 1 benchmarks/bench_balance.py --dp 8 --samples 128 --out balance.jsonl

One process plays every DP rank in turn (one GPU is enough: the ranks' work is independent until
the boundary). A rank's images run grouped by size (a ViT of each image size, the same width and
depth), every group's forward + backward timed, the fastest of --repeats; the rank's time is the
sum. Reports max / mean - 1 of the ranks' times before and after, the cost model's own
prediction of both, and how well the model's per-rank load explains the measured times (a linear
fit: fixed ms, R^2). Without a GPU it runs on the CPU (noisy: for trying the tool, not for figures).
"""

import argparse
import json
import sys
import time

import numpy as np
import torch


def build_encoders(opts, pgs, dtype, device) -> dict:
    """A vision encoder (whole, TP 1) per image size."""
    from megatron_hetero.models.vlm import build_vision_encoder
    from megatron_hetero.spec.sizes import ModelSizes

    encoders = {}
    for size in opts.sizes:
        sizes = ModelSizes(image_size=size, patch_size=opts.patch, enc_hidden_size=opts.hidden,
                           enc_num_layers=opts.layers, enc_num_attention_heads=opts.heads, hidden_size=opts.hidden)
        encoders[size] = build_vision_encoder(sizes, 1, pgs, dtype, whole=True).to(device=device, dtype=dtype)
    return encoders


def timed(fn, repeats: int, device) -> float:
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def rank_times(encoders, pixels: np.ndarray, assignment: np.ndarray, dp: int, opts, dtype, device) -> list[float]:
    """Each rank's summed forward + backward time over its images, grouped by size."""
    times = []
    for rank in range(dp):
        total = 0.0
        for size in opts.sizes:
            n = int(((assignment == rank) & (pixels == size)).sum())
            if n == 0:
                continue
            images = torch.rand(n, 3, size, size, device=device, dtype=dtype)
            encoder = encoders[size]

            def step():
                encoder(images).float().sum().backward()
            step()  # warm-up (kernel selection for this shape)
            total += timed(step, opts.repeats, device)
        times.append(total)
    return times


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=8, help="the encoder's DP ranks")
    parser.add_argument("--samples", type=int, default=128, help="samples in the global batch")
    parser.add_argument("--most-images", type=int, default=16, help="images per sample: 1 to this many")
    parser.add_argument("--sizes", type=int, nargs="+", default=[224, 336, 448], help="image sizes (pixels)")
    parser.add_argument("--patch", type=int, default=14)
    # A ViT-H-sized encoder, depth shrunk: enough work per rank that kernel launches do not dominate.
    parser.add_argument("--hidden", type=int, default=1280)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_balance.jsonl")
    opts = parser.parse_args()
    if opts.samples % opts.dp:
        parser.error(f"--samples {opts.samples} must split over --dp {opts.dp} for the by-sample baseline")
    return opts


def main() -> int:
    opts = parse_args()
    from megatron_hetero.boundary.balance import (
        balance_items,
        by_sample,
        imbalance,
        item_cost,
        rank_loads,
        skewed_batch,
    )
    from megatron_hetero.parallel.groups import build_module_groups, init_distributed
    from megatron_hetero.parallel.parallel_state import init_outside_training
    from megatron_hetero.patches import cpu
    from megatron_hetero.spec.layout import ModuleLayout

    cpu.apply()  # nothing with a GPU
    device = init_distributed()
    pgs = build_module_groups(ModuleLayout("vision", "encoder")).pgs
    init_outside_training(1234, tp_rank=0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    encoders = build_encoders(opts, pgs, dtype, device)

    for size, encoder in encoders.items():  # first calls (allocator, kernel choice) before timing
        for n in (1, 8):
            encoder(torch.rand(n, 3, size, size, device=device, dtype=dtype)).float().sum().backward()

    counts, pixels = skewed_batch(opts.samples, tuple(opts.sizes), opts.seed, opts.most_images)
    costs = item_cost((pixels // opts.patch) ** 2, opts.hidden)
    before, after = by_sample(counts, opts.dp), balance_items(costs, opts.dp)
    record = dict(dp=opts.dp, samples=opts.samples, images=int(counts.sum()), images_per_sample=[1, opts.most_images],
                  sizes=opts.sizes, hidden=opts.hidden, layers=opts.layers, dtype=str(dtype).split(".")[1],
                  predicted_before=imbalance(rank_loads(costs, before, opts.dp)),
                  predicted_after=imbalance(rank_loads(costs, after, opts.dp)))
    for name, assignment in (("before", before), ("after", after)):
        times = rank_times(encoders, pixels, assignment, opts.dp, opts, dtype, device)
        record[f"ms_{name}"] = [round(1e3 * t, 2) for t in times]
        record[f"imbalance_{name}"] = imbalance(times)
    # Rank time against its cost-model load, over both assignments: fixed ms + ms per unit of load.
    loads = np.concatenate([rank_loads(costs, a, opts.dp) for a in (before, after)])
    ms = np.concatenate([record["ms_before"], record["ms_after"]])
    (fixed, per_load), *_ = np.linalg.lstsq(np.stack([np.ones_like(loads), loads], axis=1), ms, rcond=None)
    r2 = float(1 - np.var(ms - fixed - per_load * loads) / np.var(ms))
    record.update(fit_fixed_ms=round(float(fixed), 2), fit_r2=r2)
    record.update(date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                  device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    print(json.dumps(record))
    with open(opts.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
