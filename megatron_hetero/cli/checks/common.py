"""What the GPU kernel checks (tools/gpu_norm_check.py, tools/gpu_mlp_check.py) share: the command line,
the table of each path's errors against fp32 and its times, the records and the verdict.

A check's `measure(case, iters)` returns a record with `case`, a size field, `torch_*_err` and
`quack_*_err` (max |diff| / max |ref| against fp32), with iters `torch_fwd_ms`, `torch_fwd_bwd_ms`,
`quack_fwd_ms`, `quack_fwd_bwd_ms`, and `ok`.
"""

import argparse
import json
import os
from pathlib import Path
from typing import Callable

import torch


def _errs(record: dict, label: str) -> str:
    return " / ".join(f"{record[k]:.4f}" for k in record if k.startswith(label) and k.endswith("_err"))


def line(record: dict, size: str) -> str:
    """One table row: case, the record's `size` field, both paths' errors and times, the verdict."""
    r = record
    times = (f" | {r['torch_fwd_ms']:.3f} / {r['torch_fwd_bwd_ms']:.3f} | {r['quack_fwd_ms']:.3f} / "
             f"{r['quack_fwd_bwd_ms']:.3f}" if "quack_fwd_ms" in r else " | | ")
    verdict = "ok" if r["ok"] else "FAIL"
    return f"| {r['case']} | {r[size]} | {_errs(r, 'torch')} | {_errs(r, 'quack')}{times} | {verdict} |"


def main(doc: str, problem: str | None, cases: Callable, measure: Callable, size: str, header: str,
         file_name: str, failure: str) -> int:
    """The check's command line (--quick, --out DIR; DIR defaults to $OUT or out/): exit 2 with one line
    where `problem` (the kernels do not load), else each case measured, printed and appended to
    DIR/file_name, PASS (0) or FAIL: `failure` (1)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="an eighth of the rows, fewer timing calls")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    if problem:
        print(f"error: {problem}")
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"| case | {size} | {header} | torch ms (fwd / fwd+bwd) | quack ms | |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    records = [measure(case, 5 if args.quick else 20) for case in cases(args.quick)]
    for r in records:
        print(line(r, size), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / file_name, "a") as f:
        for r in records:
            f.write(json.dumps(dict(r, device=torch.cuda.get_device_name(), torch=torch.__version__)) + "\n")
    ok = all(r["ok"] for r in records)
    print("PASS" if ok else f"FAIL: {failure}")
    return 0 if ok else 1
