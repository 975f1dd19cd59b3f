"""Two --metrics-file runs' losses side by side: loss per step, the largest difference, the means of
the last 20 steps (benchmarks/gpu_fa4_check.sh's loss comparison).

    python3 benchmarks/compare_losses.py A.jsonl B.jsonl
"""

import json
import sys
from pathlib import Path


def compare_losses(a: str, b: str) -> int:
    """Two --metrics-file runs side by side: loss per step, the largest difference."""
    runs = [{r["step"]: r["loss"] for r in map(json.loads, open(path)) if "loss" in r} for path in (a, b)]
    steps = sorted(set(runs[0]) & set(runs[1]))
    if not steps:
        print(f"no common steps with a loss in {a} and {b}")
        return 1
    print(f"| step | {Path(a).stem} | {Path(b).stem} | difference |\n| --- | --- | --- | --- |")
    for step in steps:
        print(f"| {step} | {runs[0][step]:.5f} | {runs[1][step]:.5f} | {runs[1][step] - runs[0][step]:+.5f} |")
    diffs = [abs(runs[1][s] - runs[0][s]) for s in steps]
    last = steps[-min(20, len(steps)):]
    means = [sum(r[s] for s in last) / len(last) for r in runs]
    print(f"{len(steps)} steps: max |difference| {max(diffs):.5f} (step {steps[diffs.index(max(diffs))]}), "
          f"mean of the last {len(last)}: {means[0]:.5f} vs {means[1]:.5f} ({100 * (means[1] / means[0] - 1):+.2f}%)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python3 benchmarks/compare_losses.py A.jsonl B.jsonl")
    sys.exit(compare_losses(*sys.argv[1:]))
