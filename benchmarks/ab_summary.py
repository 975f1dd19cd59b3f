"""Medians of alternating A/B benchmark runs (bench_e2e JSON lines), and each variant against the
first one of its workload: the numbers a speed change is judged by, one table (with each encoder's
MFU by itself where the records measured it: bench_e2e's encoders_alone).

    python benchmarks/ab_summary.py bench_e2e.jsonl [--peak 989] > summary.md
    python benchmarks/ab_summary.py A=base.jsonl B=new.jsonl    # two checkouts' runs, same flags

Runs of one workload, layout and batch (the layout name carries bench_e2e's --flags; with the
global and micro batch and the name a file was given, the variant) are grouped; the median of their
TFLOPS/GPU and step times is reported, with MFU against --peak (dense bf16 TFLOPS of the card: 989
for H100/H200 SXM) and the gain over the workload's first variant of the layout (the baseline: the
A/B scripts run it first, or name its file first). Medians, because one card's clock drifts between
runs and an alternating order spreads the drift over both variants.
"""

import argparse
import json
import os
import statistics
import sys


def grouped(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """(workload, variant: the layout, batch and source name) -> its runs, in the order first seen."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        variant = f"{r['layout']} gb{r['global_batch']}/mb{r['micro_batch']}"
        variant += f" ({r['source']})" if "source" in r else ""
        groups.setdefault((f"{r['workload']} L{r['llm_layers']}", variant), []).append(r)
    return groups


def alone_tflops_per_gpu(r: dict, module: str) -> float:
    """An encoder's model TFLOPS per GPU by itself (a record's encoders_alone: its slowest rank's seconds
    over the GPUs that ran it)."""
    alone = r["encoders_alone"][module]
    return r["module_tflops"][module] / alone["seconds"] / alone["gpus"]


def alone_cell(runs: list[dict], peak: float) -> str:
    """Each encoder's MFU by itself, the median over the runs that measured it ("-": none did)."""
    names = dict.fromkeys(name for r in runs for name in r.get("encoders_alone", {}))
    return ", ".join(f"{name} {100 * statistics.median(alone_tflops_per_gpu(r, name) for r in runs
                                                        if name in r.get('encoders_alone', {})) / peak:.1f}%"
                     for name in names) or "-"


def table(records: list[dict], peak: float) -> list[str]:
    lines = ["| workload | variant | runs | TFLOPS/GPU (median; each) | MFU | step s (median) | encoders alone, MFU "
             "| vs baseline |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    baseline: dict[tuple[str, str], float] = {}
    for (workload, variant), runs in grouped(records).items():
        tflops = [r["tflops_per_gpu"] for r in runs]
        median = statistics.median(tflops)
        base = baseline.setdefault((workload, variant.split(" ")[0]), median)  # the layout alone
        each = " / ".join(f"{t:.1f}" for t in tflops)
        lines.append(f"| {workload} | {variant} | {len(runs)} | {median:.1f} ({each}) | {100 * median / peak:.1f}% | "
                     f"{statistics.median(r['step_s'] for r in runs):.3f} | {alone_cell(runs, peak)} | "
                     f"{100 * (median / base - 1):+.1f}% |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jsonl", nargs="+", help="results files; NAME=FILE names its runs' variant")
    parser.add_argument("--peak", type=float, default=989.0, help="dense bf16 TFLOPS of the card")
    opts = parser.parse_args()
    records = []
    for source in opts.jsonl:
        name, _, path = source.rpartition("=")
        runs = [json.loads(line) for line in open(path) if line.strip()] if os.path.isfile(path) else []
        if not runs:
            print(f"error: no records in {path}: give a bench_e2e results file (--out)", file=sys.stderr)
            return 1
        records += [{**r, "source": name} if name else r for r in runs]
    print("\n".join(table(records, opts.peak)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
