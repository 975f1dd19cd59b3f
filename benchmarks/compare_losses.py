"""Loss curves side by side.

    python3 benchmarks/compare_losses.py A.jsonl B.jsonl     two --metrics-file runs: loss per step, the
                                                             largest difference, the means of the last 20
                                                             steps (benchmarks/gpu_fa4_check.sh's comparison)
    python3 benchmarks/compare_losses.py --runs DIR          benchmarks/gpu_loss_run.sh's compare.md: every
                                                             bench_e2e record <arm>_s<seed>[_<repeat>].jsonl in DIR
"""

import json
import re
import sys
from pathlib import Path

TAIL = 50  # the last steps whose means are compared, and the first steps that are told apart from them


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


def load_runs(directory: str) -> dict[int, dict[str, list[float]]]:
    """seed -> {run name: its per-step losses} of the bench_e2e records <arm>_s<seed>[_<repeat>].jsonl in
    `directory` (the last line of each: its record)."""
    runs: dict[int, dict[str, list[float]]] = {}
    for path in sorted(Path(directory).glob("*.jsonl")):
        match = re.fullmatch(r"([a-z0-9-]+)_s(\d+)(_\w+)?", path.stem)
        if match and path.read_text().strip():
            runs.setdefault(int(match[2]), {})[path.stem] = json.loads(path.read_text().splitlines()[-1])["losses"]
    return runs


def _unfused_first(mine: dict) -> list:
    """A seed's (name, losses), the unfused runs first, each group by name."""
    return sorted(mine.items(), key=lambda item: (not item[0].startswith("unfused_"), item[0]))


def _relative(a, b, steps) -> float:
    """The largest relative difference of a from b over these steps."""
    return max(abs(a[i] - b[i]) / abs(b[i]) for i in steps)


def against(runs: dict, arm: str, noise: str) -> list[str]:
    """Every run against its seed's first run of `arm`: the largest relative difference over all steps
    and from step TAIL + 1, that of the means of the last TAIL steps (signed), the largest absolute and
    the mean absolute difference over their common steps (once a loss is near zero, relative differences
    weigh its last digits; the mean absolute weighs the steps where the curves are apart)."""
    lines = [f"Each run against its seed's first {arm} run: the largest relative difference over all steps and"
             f" from step {TAIL + 1}, that of the means of the last {TAIL} steps (signed), the largest and the mean"
             f" absolute difference over their common steps. {noise}", "",
             f"| seed | run | steps | largest, all steps | largest, from step {TAIL + 1} | last {TAIL} steps' means "
             "| largest absolute | mean absolute |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for seed, mine in sorted(runs.items()):
        reference = next((n for n in sorted(mine) if n.startswith(arm + "_")), None)
        if reference is None:
            lines.append(f"| {seed} | no {arm} run | | | | | | |")
            continue
        ref = mine[reference]
        for name, losses in _unfused_first(mine):
            if name == reference:
                continue
            n = min(len(ref), len(losses))
            tail = range(max(0, n - TAIL), n)
            mean = lambda x: sum(x[i] for i in tail) / len(tail)  # noqa: E731
            later = _relative(losses, ref, range(TAIL, n)) if n > TAIL else float("nan")
            apart = [abs(losses[i] - ref[i]) for i in range(n)]
            lines.append(f"| {seed} | {name} vs {reference} | {n} | {_relative(losses, ref, range(n)):.2e} | "
                         f"{later:.2e} | {(mean(losses) - mean(ref)) / mean(ref):+.2e} | "
                         f"{max(apart):.2e} | {sum(apart) / n:.2e} |")
    return lines


def positions(runs: dict) -> list[str]:
    """Where each run's loss lies among its seed's unfused runs (an unfused run: among the others), step
    by step, over the first TAIL steps and after: the share of steps below all of them, inside their
    range, above all. A run like the unfused ones lies outside k others' range at 2 / (k + 1) of its
    steps when the curves are independent; curves that settle at offsets of their own lie outside at
    nearly every later step, whichever they are."""
    lines = [f"Where each run lies among its seed's unfused runs (an unfused run: among the other ones), step by "
             f"step: the share of steps below all of them / inside their range / above all, over steps 1-{TAIL} "
             "and after.", "",
             f"| seed | run | among | steps 1-{TAIL}: below / inside / above | later steps: below / inside / above |",
             "| --- | --- | --- | --- | --- |"]
    for seed, mine in sorted(runs.items()):
        unfused = sorted(n for n in mine if n.startswith("unfused_"))
        for name, losses in _unfused_first(mine):
            others = [mine[n] for n in unfused if n != name]
            if not others:
                continue
            n = min(len(losses), *map(len, others))
            cells = []
            for steps in (range(min(TAIL, n)), range(TAIL, n)):
                where = [(losses[i] < min(o[i] for o in others)) - (losses[i] > max(o[i] for o in others))
                         for i in steps]
                cells.append(" / ".join(f"{where.count(side) / max(len(where), 1):.0%}" for side in (1, 0, -1)))
            lines.append(f"| {seed} | {name} | {len(others)} unfused | {cells[0]} | {cells[1]} |")
    return lines


def runs_report(directory: str) -> str:
    """benchmarks/gpu_loss_run.sh's compare.md of the records in `directory`."""
    runs = load_runs(directory)
    lines = against(runs, "unfused", "The unfused repeats' rows are the noise (the kernels' own non-determinism).")
    if any(name.startswith("fp32_") for mine in runs.values() for name in mine):
        lines += [""] + against(runs, "fp32", "How far each bf16 path lies from fp32 weights and compute: the fused "
                                              "path's rows beside the unfused runs' say whether its kernels cost "
                                              "accuracy or only round differently.")
    return "\n".join(lines + [""] + positions(runs))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--runs":
        print(runs_report(sys.argv[2]))
    elif len(sys.argv) == 3:
        sys.exit(compare_losses(*sys.argv[1:]))
    else:
        sys.exit("usage: python3 benchmarks/compare_losses.py A.jsonl B.jsonl | --runs DIR")
