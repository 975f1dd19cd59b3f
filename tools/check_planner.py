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
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_e2e  # noqa: E402  (puts the repository root on sys.path)

from megatron_hetero.layout import LayoutError, load_layout  # noqa: E402
from megatron_hetero.planner import (  # noqa: E402
    Calibration,
    Cluster,
    CostModel,
    candidate_from_layout,
    head_forward_flops_per_sample,
    layer_forward_flops_per_token,
)

LAYOUTS = bench_e2e.ROOT / "examples" / "layouts"
DEFAULT_CALIBRATION = Path(__file__).resolve().parent / "calibration_h200.json"
H200_MEMORY_GB = 150.7  # nvidia-smi: 143771 MiB
GIB = 2**30 / 1e9


@dataclass(frozen=True, eq=False)  # each run is itself (hashed by identity)
class Run:
    """One measured (or out-of-memory) run of a group: its layout file and what bench_e2e recorded."""

    layout: str
    micro_batch: int
    tokens_per_s: float | None  # None: ran out of memory
    peak_gb: float | None
    phases: dict


@dataclass(frozen=True)
class Observation:
    """A module's forward and backward in one run, on one GPU: samples and tokens it processed per
    step, and its time in forward-pass equivalents (forward + backward over 3; frozen: forward)."""

    module: str
    tp: int
    cp: int
    samples: float
    tokens: float
    forward_s: float


def observations(run: Run, workload, gpus: int) -> list[Observation]:
    """The run's non-pipelined modules, with the share of the global batch one of their GPUs runs."""
    layout = load_layout(str(LAYOUTS / f"{run.layout}.yaml"), gpus)
    found = []
    for module in layout.modules:
        if module.pp > 1:
            continue
        shape = workload.llm if module.role == "llm" else workload.encoders[0]
        cp = module.cp if module.role == "llm" else 1
        samples = workload.global_batch / module.dp
        forward, backward = (run.phases[f"{module.role}-{way}"] for way in ("forward", "backward"))
        passes = forward if shape.frozen else (forward + backward) / 3
        found.append(Observation(module.role, module.tp, cp, samples, samples * shape.tokens_per_sample / cp, passes))
    return found


def fit(runs: list[Run], workload, gpus: int, base: Calibration) -> Calibration:
    """The base calibration with max_efficiency and layer_forward_us_per_token fitted to the runs."""
    shapes = {"encoder": workload.encoders[0], "llm": workload.llm}
    seen = [o for run in runs if run.tokens_per_s is not None for o in observations(run, workload, gpus)]
    if not seen:
        return base
    cluster = Cluster(gpus, H200_MEMORY_GB)

    def head_flops(o: Observation) -> float:
        return o.samples * head_forward_flops_per_sample(shapes[o.module], workload.llm.hidden) / (o.tp * o.cp)

    def flops(o: Observation) -> float:
        shape = shapes[o.module]
        return o.tokens * shape.layers * layer_forward_flops_per_token(shape) / o.tp + head_flops(o)

    unit = CostModel(workload, cluster, replace(base, max_efficiency=1.0))  # efficiency(...) = width factor
    implied = [flops(o) / (o.forward_s * base.matmul_tflops * 1e12 * unit.efficiency(shapes[o.module], o.tp))
               for o in seen if o.cp == 1]
    fitted = replace(base, max_efficiency=min(1.0, statistics.median(implied)) if implied else base.max_efficiency)
    model = CostModel(workload, cluster, fitted)
    per_key = defaultdict(list)
    for o in seen:
        shape = shapes[o.module]
        head_s = head_flops(o) / (fitted.matmul_tflops * 1e12 * model.efficiency(shape, o.tp))
        per_key[shape.name, o.tp, o.cp].append(1e6 * (o.forward_s - head_s) / (shape.layers * o.tokens))
    times = defaultdict(dict)
    for (name, tp, cp), values in sorted(per_key.items()):
        times[name][str(tp) if cp == 1 else f"tp{tp}cp{cp}"] = statistics.mean(values)
    fitted = Calibration(**{**fitted.to_dict(), "layer_forward_us_per_token": dict(times)})
    factors = []
    for run in runs:
        if run.peak_gb is not None:
            once, twice = (predict(run, workload, gpus, replace(fitted, activation_memory_factor=f)).memory_gb
                           for f in (1.0, 2.0))  # memory is linear in the factor
            activations = twice - once
            factors.append((run.peak_gb * GIB - (once - activations)) / activations)
    return replace(fitted, activation_memory_factor=max(factors, default=base.activation_memory_factor),
                   source="max_efficiency, layer_forward_us_per_token and activation_memory_factor fitted by "
                          f"tools/check_planner.py to bench_e2e runs; the other keys: {base.source}")


def predict(run: Run, workload, gpus: int, calibration: Calibration):
    """The planner's prediction for the run's layout at the run's micro batch size."""
    layout = load_layout(str(LAYOUTS / f"{run.layout}.yaml"), gpus)
    cluster = Cluster(gpus, H200_MEMORY_GB)
    (candidate,) = candidate_from_layout(layout, replace(workload, micro_batch=run.micro_batch), cluster)
    return CostModel(workload, cluster, calibration).predict(candidate)


def check_group(name: str, runs: list[Run], workload, gpus: int, base: Calibration, leave_one_out: bool):
    """Prints the group's table; returns (whether the rankings agree, the fitted calibration)."""
    fitted = fit(runs, workload, gpus, base)
    rows = []
    for run in runs:
        calibration = fit([r for r in runs if r is not run], workload, gpus, base) if leave_one_out else fitted
        rows.append((run, predict(run, workload, gpus, calibration)))
    measured = sorted((r for r, _ in rows if r.tokens_per_s is not None), key=lambda r: -r.tokens_per_s)
    prediction = dict(rows)
    predicted = sorted((r for r, p in rows if p.fits), key=lambda r: prediction[r].step_s)
    over = [r for r, p in rows if not p.fits]
    oom = [r for r, _ in rows if r.tokens_per_s is None]
    agree = [r.layout for r in measured] == [r.layout for r in predicted] and \
        sorted(r.layout for r in over) == sorted(r.layout for r in oom)
    print(f"\n{name}: max_efficiency {fitted.max_efficiency:.3f}; layer us per token "
          f"{json.dumps(fitted.to_dict()['layer_forward_us_per_token'])}")
    print("| layout | measured tokens/s | rank | predicted tokens/s | rank | measured GB | predicted GB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for run, p in sorted(rows, key=lambda rp: -(rp[0].tokens_per_s or 0)):
        m_rank = measured.index(run) + 1 if run in measured else "OOM"
        p_rank = predicted.index(run) + 1 if run in predicted else "over memory"
        m_tok = f"{run.tokens_per_s:,.0f}" if run.tokens_per_s else "-"
        m_gb = f"{run.peak_gb * GIB:.0f}" if run.peak_gb else "-"
        print(f"| {run.layout} | {m_tok} | {m_rank} | {p.tokens_per_s:,.0f} | {p_rank} | {m_gb} | {p.memory_gb:.0f} |")
    print(f"rankings {'agree' if agree else 'DISAGREE'}")
    return agree, fitted


def groups(records: list[dict], oom: list[str]) -> dict:
    """{(workload, llm layers, gpus, global batch): [Run]} of our layouts' runs and the named
    out-of-memory ones (at the group's first micro batch size)."""
    found = defaultdict(list)
    for r in records:
        if (LAYOUTS / f"{r['layout']}.yaml").exists():
            w = bench_e2e.WORKLOADS[r["workload"]]  # runs recorded before batch sizes were: the workload's
            key = r["workload"], r["llm_layers"], r["gpus"], r.get("global_batch", w.global_batch)
            found[key].append(Run(r["layout"], r.get("micro_batch", w.micro_batch), r["tokens_per_s"],
                                  r["peak_gb_max"], r["phases"]))
    for item in oom:
        parts = item.split(":")
        if len(parts) != 3 or not parts[1].isdigit():
            raise ValueError(f"--oom {item}: write workload:LLM layers:layout, e.g. W2:8:gpu2_homogeneous_dp2")
        workload, layers, layout = parts
        key = next((k for k in found if k[:2] == (workload, int(layers))), None)
        if key is None:
            raise ValueError(f"--oom {item}: no measured run of {workload} with {layers} LLM layers to compare with")
        found[key].append(Run(layout, found[key][0].micro_batch, None, None, {}))
    return found


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
            frozen = name == "W3"
            w = replace(bench_e2e.WORKLOADS[name], layers=layers, global_batch=global_batch)
            workload = bench_e2e.planner_workload(w, vocab_size(w), frozen)
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


def vocab_size(w) -> int:
    """The padded vocabulary the trainer builds for the workload (the demo tokenizer's)."""
    from megatron_hetero.data.tokenizer import CaptionTokenizer
    from megatron_hetero.training.args import model_sizes
    from megatron_hetero.models.vlm import padded_vocab_size

    args = bench_e2e._args(w, str(LAYOUTS / "single.yaml"), bf16=False)
    return padded_vocab_size(model_sizes(args, CaptionTokenizer().vocab_size))


if __name__ == "__main__":
    sys.exit(main())
