"""Check the layout planner against bench_e2e measurements: fit its calibration to the runs, predict
every measured layout, and print the predicted ranking beside the measured one.

    python tools/check_planner.py docs/runs/bench_e2e/results.jsonl \\
        [--oom W2:8:gpu2_homogeneous_dp2 ...] [--calibration tools/calibration_h200.json] \\
        [--write-calibration measured.json]

Runs are grouped by workload and LLM depth. Per group, the calibration starts from --calibration and
takes from the group's runs of our layouts (examples/layouts/<layout>.yaml; upstream rows are
left out):
- max_efficiency: the median over runs and modules of the efficiency the measured phases imply
  (model FLOPs of a GPU's share / time / matmul_tflops / the width factor of its TP size);
- layer_forward_us_per_token per module and (TP, CP) size, where the module is not pipelined: a
  third of its forward + backward phases (the model's backward is 2 x forward; a frozen module's
  forward alone) minus the head (projector or embedding and logits, at the fitted efficiency), per
  layer and token of one GPU, averaged over the runs with that layout;
- activation_memory_factor: the largest over runs of (measured peak - the model's weights,
  gradients and optimizer states) / the model's activations, so that the planner errs toward
  "over memory".
With --leave-one-out each run is predicted from a calibration fitted to the others only (its own
layer times then come from the efficiency fit when no other run has its layout).
--oom names runs that ran out of GPU memory (workload:LLM layers:layout): the planner should
predict them over memory.
"""

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

from megatron_hetero.layout import LayoutError, load_layout
from megatron_hetero.planner import BENCH_WORKLOADS, Calibration, trainer_workload
from megatron_hetero.planner.fit import GIB, Run, fit, predict_run
from megatron_hetero.training.bench import trainer_vocab_size

LAYOUTS = Path(__file__).resolve().parents[1] / "examples" / "layouts"
DEFAULT_CALIBRATION = Path(__file__).resolve().parent / "calibration_h200.json"


def check_group(name: str, runs: list[Run], workload, gpus: int, base: Calibration, leave_one_out: bool):
    """Prints the group's table; returns (whether the rankings agree, the fitted calibration)."""
    fitted = fit(runs, workload, gpus, base)
    rows = []
    for run in runs:
        calibration = fit([r for r in runs if r is not run], workload, gpus, base) if leave_one_out else fitted
        rows.append((run, predict_run(run, workload, gpus, calibration)))
    measured = sorted((r for r, _ in rows if r.tokens_per_s is not None), key=lambda r: -r.tokens_per_s)
    prediction = dict(rows)
    predicted = sorted((r for r, p in rows if p.fits), key=lambda r: prediction[r].step_s)
    over = [r for r, p in rows if not p.fits]
    oom = [r for r, _ in rows if r.tokens_per_s is None]
    agree = [r.name for r in measured] == [r.name for r in predicted] and \
        sorted(r.name for r in over) == sorted(r.name for r in oom)
    print(f"\n{name}: max_efficiency {fitted.max_efficiency:.3f}; layer us per token "
          f"{json.dumps(fitted.to_dict()['layer_forward_us_per_token'])}")
    print("| layout | measured tokens/s | rank | predicted tokens/s | rank | measured GB | predicted GB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for run, p in sorted(rows, key=lambda rp: -(rp[0].tokens_per_s or 0)):
        m_rank = measured.index(run) + 1 if run in measured else "OOM"
        p_rank = predicted.index(run) + 1 if run in predicted else "over memory"
        m_tok = f"{run.tokens_per_s:,.0f}" if run.tokens_per_s else "-"
        m_gb = f"{run.peak_gb * GIB:.0f}" if run.peak_gb else "-"
        print(f"| {run.name} | {m_tok} | {m_rank} | {p.tokens_per_s:,.0f} | {p_rank} | {m_gb} | {p.memory_gb:.0f} |")
    print(f"rankings {'agree' if agree else 'DISAGREE'}")
    return agree, fitted


def groups(records: list[dict], oom: list[str]) -> dict:
    """{(workload, llm layers, gpus, global batch): [Run]} of our layouts' runs and the named
    out-of-memory ones (at the group's first micro batch size)."""
    found = defaultdict(list)
    for r in records:
        if (LAYOUTS / f"{r['layout']}.yaml").exists():
            w = BENCH_WORKLOADS[r["workload"]]  # runs recorded before batch sizes were: the workload's
            key = r["workload"], r["llm_layers"], r["gpus"], r.get("global_batch", w.global_batch)
            found[key].append(Run(r["layout"], _layout(r["layout"], r["gpus"]), r.get("micro_batch", w.micro_batch),
                                  r["tokens_per_s"], r["peak_gb_max"], r["phases"]))
    for item in oom:
        parts = item.split(":")
        if len(parts) != 3 or not parts[1].isdigit():
            raise ValueError(f"--oom {item}: write workload:LLM layers:layout, e.g. W2:8:gpu2_homogeneous_dp2")
        workload, layers, layout = parts
        key = next((k for k in found if k[:2] == (workload, int(layers))), None)
        if key is None:
            raise ValueError(f"--oom {item}: no measured run of {workload} with {layers} LLM layers to compare with")
        found[key].append(Run(layout, _layout(layout, key[2]), found[key][0].micro_batch, None, None, {}))
    return found


def _layout(name: str, gpus: int):
    return load_layout(str(LAYOUTS / f"{name}.yaml"), gpus)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="bench_e2e JSON lines")
    parser.add_argument("--oom", nargs="*", default=[], metavar="WORKLOAD:LAYERS:LAYOUT")
    parser.add_argument("--calibration", default=str(DEFAULT_CALIBRATION))
    parser.add_argument("--leave-one-out", action="store_true")
    parser.add_argument("--write-calibration", metavar="FILE", help="the calibration fitted to the first group")
    opts = parser.parse_args(argv)
    try:
        base = Calibration.load(opts.calibration)
        records = [json.loads(line) for line in open(opts.results) if line.strip()]
        all_agree, first = True, None
        for (name, layers, gpus, global_batch), runs in groups(records, opts.oom).items():
            w = replace(BENCH_WORKLOADS[name], layers=layers, global_batch=global_batch)
            workload = trainer_workload(w, trainer_vocab_size(), w.frozen)
            agree, fitted = check_group(f"{name}, LLM {layers} layers, {gpus} GPUs, global batch {global_batch}",
                                        runs, workload, gpus, base, opts.leave_one_out)
            all_agree &= agree
            first = first or fitted
    except (OSError, ValueError, LayoutError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if opts.write_calibration and first:
        Path(opts.write_calibration).write_text(json.dumps(first.to_dict(), indent=2) + "\n")
    return 0 if all_agree else 1


if __name__ == "__main__":
    sys.exit(main())
