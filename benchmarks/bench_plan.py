"""Time the boundary plan (pure CPU math): one rank's routes for one microbatch of many images.

    python benchmarks/bench_plan.py [--images 64] [--samples 8] [--tokens-per-image 729 256] [--gap 1]
        [--repeats 5]

A sample's images follow one text token, `gap` text tokens apart (so each image's tokens are a run).
As the runtime plans (families/parts.py), each image is an item whose encoder DP rank comes from
boundary.assign_items, computed inside each timed call (a step pays it, cached plan or not);
--by-sample plans without items (each encoder DP rank a slice of the samples).

Each timed call plans a fresh BoundaryBatch (its runs not yet found), for each of the 8 ranks:
"plan" is plan_edge; "+ index" adds spelling out its four index arrays row by row (what the first
exchange of a plan does, once); "cached" is a PlanCache hit for a fresh batch of the same metadata
(what a step with fixed image sizes pays).
"""

import argparse
import time
from dataclasses import replace

import numpy as np

from megatron_hetero.boundary import BoundaryBatch, PlanCache, assign_items, plan_edge
from megatron_hetero.spec.layout import ModuleLayout

PAIRS = [  # (encoder, llm) on 8 ranks
    (dict(dp=8), dict(tp=2, cp=4, sp=True)),
    (dict(tp=2, dp=4), dict(tp=4, dp=2)),
    (dict(dp=8), dict(tp=8)),
]


def timed(fn, batch: BoundaryBatch, repeats: int) -> float:
    """Median seconds of fn(fresh copy of batch)."""
    times = []
    for _ in range(repeats):
        fresh = replace(batch)
        start = time.perf_counter()
        fn(fresh)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def spelled(plan) -> None:
    for routes in (plan.forward, plan.backward):
        routes.send_index, routes.recv_index  # noqa: B018


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens-per-image", type=int, nargs="+", default=[729, 256])
    parser.add_argument("--gap", type=int, default=1, help="text tokens between a sample's images")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--by-sample", action="store_true", help="no items: encoder DP ranks take samples")
    args = parser.parse_args()
    world = 8
    print(f"plan_edge, one rank's routes; {args.images} images over {args.samples} samples, gap "
          f"{args.gap}, {'by sample' if args.by_sample else 'images balanced as items'}; median and max over "
          f"ranks of the median of {args.repeats} runs")
    images = args.images // args.samples
    for tokens in args.tokens_per_image:
        image = np.arange(images)[:, None] * (tokens + args.gap) + np.arange(tokens)
        positions = 1 + image.ravel()
        seq = -(-(positions[-1] + 512) // 64) * 64
        batch = BoundaryBatch(np.full(args.samples, positions.size), np.tile(positions, args.samples), seq)
        for enc, llm in PAIRS:
            encoder, llm_layout = ModuleLayout("vision", "encoder", **enc), ModuleLayout("llm", "llm", **llm)

            def items(b, tokens=tokens, dp=encoder.dp):  # what the model's adapter adds per microbatch
                if args.by_sample:
                    return b
                per_item = np.full(args.images, tokens)
                return replace(b, item_rows=per_item, item_dp=assign_items(per_item, 1152, dp))
            plan = np.array([timed(lambda b: plan_edge(items(b), encoder, llm_layout, rank, world), batch,
                                   args.repeats) for rank in range(world)])
            full = np.array([timed(lambda b: spelled(plan_edge(items(b), encoder, llm_layout, rank, world)), batch,
                                   args.repeats) for rank in range(world)])
            cache = PlanCache()
            cache.plan(items(batch), encoder, llm_layout, 0, world)
            cached = timed(lambda b: cache.plan(items(b), encoder, llm_layout, 0, world), batch, args.repeats)
            print(f"{tokens:4d} tokens/image, {batch.num_rows:6d} rows | encoder {enc} -> llm {llm} | "
                  f"plan {1e3 * np.median(plan):5.2f} ms median, {1e3 * plan.max():5.2f} ms max | "
                  f"+ index {1e3 * np.median(full):5.2f} ms median, {1e3 * full.max():5.2f} ms max | "
                  f"cached {1e3 * cached:5.3f} ms")


if __name__ == "__main__":
    main()
