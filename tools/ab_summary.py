"""Medians of alternating A/B benchmark runs (bench_e2e JSON lines), and each variant against the
first one of its workload: the numbers a speed change is judged by, one table.

    python tools/ab_summary.py bench_e2e.jsonl [--peak 989] > summary.md

Runs of one workload, layout and batch (the layout name carries bench_e2e's --flags; with the
global and micro batch, the variant) are grouped; the median of their TFLOPS/GPU and step times is
reported, with MFU against --peak (dense bf16 TFLOPS of the card: 989 for H100/H200 SXM) and the gain
over the workload's first variant and layout (the baseline: the A/B scripts run it first). Medians,
because one card's clock drifts between runs and an alternating order spreads the drift over both
variants.
"""

import argparse
import json
import statistics
import sys


def grouped(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """(workload, variant: the layout and batch) -> its runs, in the order first seen."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        variant = f"{r['layout']} gb{r['global_batch']}/mb{r['micro_batch']}"
        groups.setdefault((f"{r['workload']} L{r['llm_layers']}", variant), []).append(r)
    return groups


def table(records: list[dict], peak: float) -> list[str]:
    lines = ["| workload | variant | runs | TFLOPS/GPU (median; each) | MFU | step s (median) | vs baseline |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    baseline: dict[tuple[str, str], float] = {}
    for (workload, variant), runs in grouped(records).items():
        tflops = [r["tflops_per_gpu"] for r in runs]
        median = statistics.median(tflops)
        base = baseline.setdefault((workload, variant.split(" ")[0]), median)  # the layout without flags and batch
        each = " / ".join(f"{t:.1f}" for t in tflops)
        lines.append(f"| {workload} | {variant} | {len(runs)} | {median:.1f} ({each}) | {100 * median / peak:.1f}% | "
                     f"{statistics.median(r['step_s'] for r in runs):.3f} | {100 * (median / base - 1):+.1f}% |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jsonl")
    parser.add_argument("--peak", type=float, default=989.0, help="dense bf16 TFLOPS of the card")
    opts = parser.parse_args()
    records = [json.loads(line) for line in open(opts.jsonl) if line.strip()]
    if not records:
        print(f"error: no records in {opts.jsonl}", file=sys.stderr)
        return 1
    print("\n".join(table(records, opts.peak)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
