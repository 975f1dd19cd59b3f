"""The host's per-microbatch layout of Qwen2.5-VL's packed ViT (`grid_layout`: transformers' window
index, positions and segments, our varlen plans) under N intra-op threads, with and without other
busy cores.

    python benchmarks/bench_host_threads.py [--threads 1 N] [--busy 0 1] [--out FILE.jsonl]

torchrun sets OMP_NUM_THREADS=1 where it starts more than one process and leaves it unset for one, where
torch takes a thread per core. These ops are small: parallel regions gain nothing, and wait for every
thread of the region, which a core busy with other work (a data loader worker, another process)
holds back. The images are the Qwen2.5-VL-7B preset's (224-1344 px at the sizes its processor gives them;
6 images: the first six), one microbatch's layout per call.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import replace

import torch
from bench import family_batch

from megatron_hetero.families.qwen2_5_vl.vision import QwenVisionArch, grid_layout
from megatron_hetero.planner.presets import FAMILY_BENCH_WORKLOADS, resized_workload

WORKLOAD = "qwen2_5_vl_7b"


def preset_grids(images: int) -> torch.Tensor:
    """[images, 3] patch grids (t, h, w) of a sample of the preset's first `images` images, as bench_e2e's
    step makes them (the family's processor)."""
    workload = resized_workload(FAMILY_BENCH_WORKLOADS[WORKLOAD], items_per_sample=images)
    sample = family_batch(replace(workload, global_batch=1))[0]
    return sample.media["vision"].grids


def time_layout(grids: torch.Tensor, repeats: int) -> float:
    """Median ms of one grid_layout call."""
    arch = QwenVisionArch()
    for _ in range(3):
        grid_layout(grids, arch)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        grid_layout(grids, arch)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count()],
                        help="intra-op thread counts (default: 1 and one per core)")
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1], help="cores kept busy by spinning processes")
    parser.add_argument("--images", type=int, nargs="+", default=[6, 8])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", help="append the records to this JSON-lines file")
    opts = parser.parse_args()
    grids = {images: preset_grids(images) for images in opts.images}  # before any core is kept busy
    print("| images | patches | busy cores | threads | ms a call (median) |\n| --- | --- | --- | --- | --- |")
    for busy in opts.busy:
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            for images in opts.images:
                patches = int(grids[images].prod(1).sum())
                for threads in opts.threads:
                    torch.set_num_threads(threads)
                    ms = time_layout(grids[images], opts.repeats)
                    print(f"| {images} | {patches} | {busy} | {threads} | {ms:.2f} |", flush=True)
                    if opts.out:
                        with open(opts.out, "a") as f:
                            f.write(json.dumps(dict(images=images, patches=patches, busy_cores=busy, threads=threads,
                                                    ms=ms, repeats=opts.repeats, cores=os.cpu_count(),
                                                    cpu=platform.processor() or platform.machine(),
                                                    torch=torch.__version__, date=time.strftime("%Y-%m-%d"))) + "\n")
        finally:
            for spinner in spinners:
                spinner.kill()


if __name__ == "__main__":
    main()
