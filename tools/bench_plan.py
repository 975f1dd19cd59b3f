"""Time the boundary plan (pure CPU math): one rank's routes for one microbatch of many images.

    python tools/bench_plan.py [--images 64] [--tokens-per-image 729 256] [--world-size 8]
"""

import argparse
import time

import numpy as np

from megatron_hetero.boundary import BoundaryBatch, PlanCache, plan_edge
from megatron_hetero.layout import ModuleLayout

PAIRS = [  # (encoder, llm) on 8 ranks
    (dict(dp=8), dict(tp=2, cp=4, sp=True)),
    (dict(tp=2, dp=4), dict(tp=4, dp=2)),
    (dict(dp=8), dict(tp=8)),
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens-per-image", type=int, nargs="+", default=[729, 256])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    world = 8
    print(f"plan_edge, one rank's routes; {args.images} images over {args.samples} samples; "
          f"median and max over ranks of the median of {args.repeats} runs")
    for tokens in args.tokens_per_image:
        per_sample = args.images // args.samples * tokens
        seq = -(-(per_sample + 512) // 64) * 64
        batch = BoundaryBatch(np.full(args.samples, per_sample),
                              np.tile(np.arange(1, 1 + per_sample), args.samples), seq)
        for enc, llm in PAIRS:
            encoder, llm_layout = ModuleLayout("vision", "encoder", **enc), ModuleLayout("llm", "llm", **llm)
            per_rank = []
            for rank in range(world):
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    plan_edge(batch, encoder, llm_layout, rank, world)
                    times.append(time.perf_counter() - start)
                per_rank.append(np.median(times))
            cache = PlanCache()
            cache.plan(batch, encoder, llm_layout, 0, world)
            start = time.perf_counter()
            cache.plan(batch, encoder, llm_layout, 0, world)
            cached = time.perf_counter() - start
            print(f"{tokens:4d} tokens/image, {batch.num_rows:6d} rows | encoder {enc} -> llm {llm} | "
                  f"plan {1e3 * np.median(per_rank):6.2f} ms median, {1e3 * max(per_rank):6.2f} ms max | "
                  f"cached {1e3 * cached:5.3f} ms")


if __name__ == "__main__":
    main()
