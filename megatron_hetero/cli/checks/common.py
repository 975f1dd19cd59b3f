"""What the GPU kernel checks share: CUDA-event timing and the GPU's own time (gpu_ms); a case's
record of two paths' errors against fp32 and their times (measure_paths: norms.py, mlp.py, experts.py,
loss.py, triton.py); for the checks of one kernel path against torch's (the quack checks norms.py,
mlp.py, loss.py; triton.py) the table of those records, the records' file and the verdict.

Such a check's `measure(case, iters)` returns a record with `case`, a size field, `torch_*_err` and
`<judged>_*_err` (max |diff| / max |ref| against fp32; `judged`: "quack" or "triton"), with iters
`torch_fwd_ms`, `torch_fwd_bwd_ms`, `torch_gpu_ms`, the same of `<judged>`, and `ok`. The `fwd*` times
are of calls back to back, whose pace the host's launches set where a call's kernels take less time
than its launch; `gpu_ms`, the forward and backward's kernels, copies and fills on the GPU alone, tells
the two apart.
"""

import json
from pathlib import Path
from typing import Callable, NamedTuple

import torch


def timed(fn, iters: int) -> float:
    """Milliseconds per call (CUDA events, after two warm-up calls)."""
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def device_work(events) -> list:
    """The profiler events of kernels, copies and fills on the GPU: not the device-side copies of annotated
    ranges (record_function's, the optimizer's step), which span the kernels inside them (as torch's own
    tables leave them out)."""
    return [e for e in events if e.device_type.name == "CUDA" and e.self_device_time_total > 0
            and not getattr(e, "is_user_annotation", False)]


def gpu_ms(fn, iters: int) -> float:
    """Milliseconds of the GPU's work per call (device_work under torch.profiler, after one warm-up call):
    the host's pace left out."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in device_work(prof.events())) / 1e3 / iters


def measure_paths(record: dict, case, paths: dict[str, Callable], errors: Callable, calls: Callable, iters: int,
                  judged: str, tolerance: float) -> dict:
    """`record` (the case's fields) with each of `paths` (label -> path) measured on `case`:
    errors(path, case) -> {name: max |diff| / max |ref| against fp32} as `{label}_{name}_err`; with
    iters, calls(path, case) -> (a forward call, a forward and backward call) timed as `{label}_fwd_ms`,
    `{label}_fwd_bwd_ms` and `{label}_gpu_ms` (the second's GPU work alone); ok: every error of the
    `judged` path within tolerance."""
    for label, path in paths.items():
        record.update({f"{label}_{name}_err": e for name, e in errors(path, case).items()})
        if iters:
            forward, both = calls(path, case)
            record.update({f"{label}_fwd_ms": timed(forward, iters), f"{label}_fwd_bwd_ms": timed(both, iters),
                           f"{label}_gpu_ms": gpu_ms(both, iters)})
    record["ok"] = all(e <= tolerance for key, e in record.items()
                       if key.startswith(f"{judged}_") and key.endswith("_err"))
    return record


def _errs(record: dict, label: str) -> str:
    return " / ".join(f"{record[k]:.4f}" for k in record if k.startswith(label) and k.endswith("_err"))


def line(record: dict, size: str, judged: str = "quack") -> str:
    """One table row: case, the record's `size` field, both paths' errors and times, the verdict."""
    r = record
    times = ("".join(f" | {r[f'{label}_fwd_ms']:.3f} / {r[f'{label}_fwd_bwd_ms']:.3f} / {r[f'{label}_gpu_ms']:.3f}"
                     for label in ("torch", judged)) if f"{judged}_fwd_ms" in r else " | | ")
    verdict = "ok" if r["ok"] else "FAIL"
    return f"| {r['case']} | {r[size]} | {_errs(r, 'torch')} | {_errs(r, judged)}{times} | {verdict} |"


class KernelCheck(NamedTuple):
    """A check of one kernel path (`judged`) against torch's: `problem()` (why the kernels do not load, or
    None), `cases(quick)`, `measure`; the table's `size` field and error `header`, the records' `file_name`,
    what a failure means, the environment assignments that keep the layers on torch's kernels, what a
    pass means."""

    problem: Callable
    cases: Callable
    measure: Callable
    size: str
    header: str
    file_name: str
    failure: str
    fallback: str
    passed: str = "quack's kernels are right here (the default, auto, runs them on sm90 and sm100 GPUs)"
    judged: str = "quack"


def run_table(check: KernelCheck, quick: bool, out: str) -> int:
    """Exit 2 with one line where the kernels do not load, else each case measured, printed and
    appended to out/file_name, PASS (0) or FAIL (1), and what to do with the result."""
    problem = check.problem()
    if problem:
        print(f"error: {problem}")
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"| case | {check.size} | {check.header} | torch ms (fwd / fwd+bwd / its GPU work) | {check.judged} ms | |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    records = [check.measure(case, 5 if quick else 20) for case in check.cases(quick)]
    for r in records:
        print(line(r, check.size, check.judged), flush=True)
    Path(out).mkdir(parents=True, exist_ok=True)
    with open(Path(out) / check.file_name, "a") as f:
        for r in records:
            f.write(json.dumps(dict(r, device=torch.cuda.get_device_name(), torch=torch.__version__)) + "\n")
    if all(r["ok"] for r in records):
        print(f"PASS: {check.passed}")
        return 0
    print(f"FAIL: {check.failure}; keep the layers on torch's kernels: export {check.fallback}")
    return 1
