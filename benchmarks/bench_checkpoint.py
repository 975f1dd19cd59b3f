"""Save and load time and size of a Megatron checkpoint (torch_dist, through megatron.training's
save_checkpoint / load_checkpoint with megatron-hetero's patches) of one workload under one layout.

    torchrun --nproc-per-node 1 benchmarks/bench_checkpoint.py --workload W1 --llm-layers 8 \
        --hetero-layout examples/layouts/single.yaml --dir /tmp/ckpt --out checkpoint.jsonl

Workloads and their flags are benchmarks/bench_e2e.py's (benchmarks/bench.py).
"""

import argparse
import sys
from pathlib import Path

import torch
from bench import (
    measure_checkpoint,
    megatron_trainer,
    run_reporting_errors,
    sized_workload,
)

import megatron_hetero.patches
from megatron_hetero.planner import BENCH_WORKLOADS


def run(opts) -> dict:
    import os

    from megatron_hetero.spec.layout import load_layout

    layout = load_layout(opts.hetero_layout, int(os.environ.get("WORLD_SIZE", 1)))
    w = sized_workload(BENCH_WORKLOADS[opts.workload], layout, opts.llm_layers)
    bf16 = torch.cuda.is_available()
    megatron_hetero.patches.apply()
    with megatron_trainer(w, opts.hetero_layout, bf16, opts.extra) as trainer:
        return measure_checkpoint(trainer, w, Path(opts.hetero_layout).stem, opts.dir, opts.out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=list(BENCH_WORKLOADS), default="tiny")
    parser.add_argument("--hetero-layout", required=True)
    parser.add_argument("--llm-layers", type=int, default=0, help="shrink the LLM's depth to fit")
    parser.add_argument("--dir", required=True, help="the checkpoint directory (written)")
    parser.add_argument("--out", default="bench_checkpoint.jsonl")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="further Megatron flags, e.g. --use-distributed-optimizer")
    return run_reporting_errors(run, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
