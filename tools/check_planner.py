"""Check the layout planner against bench_e2e measurements: fit its calibration to the runs, predict
every measured layout, and print the predicted ranking and the predicted gain of the best
heterogeneous layout over the best homogeneous one beside the measured ones.

    python tools/check_planner.py docs/runs/bench_e2e/results.jsonl \\
        [--oom W2:8:gpu2_homogeneous_dp2 ...] \\
        [--calibration megatron_hetero/planner/calibrations/calibration_h200.json] \\
        [--leave-one-out] [--write-calibration measured.json]
    python tools/check_planner.py docs/runs/gpu2/*/bench_e2e*.jsonl \\
        docs/runs/gpu2/baselines/w1_colocated.jsonl --oom W5:12:gpu2_homogeneous_dp2:FLAGS
    (FLAGS: the out-of-memory run's, comma separated; docs/runs/planner/check_gpu2.txt starts with
    the whole command)
    python tools/check_planner.py --memory $(find docs/runs -name '*.jsonl')

Runs of our layouts (examples/layouts/<layout>.yaml; upstream rows are left out) are grouped by
workload, LLM depth, GPU count and global batch; the Megatron flags a run added (bench_e2e's
`layout [flags]`: the distributed optimizer, full or block recomputation) are part of its layout,
and a later record of the same layout and flags (the files in the order given) replaces an earlier
one. Per group, the calibration starts from
--calibration and takes the efficiency curve, the layer times per layer shape and layout, and the
activation memory factor fitted to the group's runs (tools/planner_fit.py says how), and
the planner predicts every run at its micro batch size. Then the curve is fitted to every group's
runs, and each measured layer shape is predicted from the curve fitted without it: how well the
curve stands in for the shapes that were not measured. --write-calibration writes that fit of
every group (curve, every measured shape's layer time, the least-squares memory factor).
With --leave-one-out each run is predicted from a calibration fitted to its group's other runs only
(its own layer times then come from the curve when no other run has its layout).
--oom names runs that ran out of GPU memory (workload:LLM layers:layout[:flags], the flags comma
separated as benchmarks/gpu2_layouts_run.sh's RUNS): the planner should predict them over memory.
--memory checks the memory model instead: every one-GPU record of the current trainer among the files
(planner_fit.band_records) predicted with the shipped calibration of its GPU model against its
measured peak, in or out of the band (at most 1 GB under, at most 3% over), and the activation
memory factors by role and attention kernel those records fit (the shipped calibrations' own).
"""

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import planner_fit as pf

from megatron_hetero.planner import Calibration
from megatron_hetero.planner.calibration import DEFAULT_CALIBRATION
from megatron_hetero.planner.presets import trainer_vocab_size
from megatron_hetero.spec.layout import LayoutError, load_layout

LAYOUTS = Path(__file__).resolve().parents[1] / "examples" / "layouts"


def _curve(calibration: Calibration) -> str:
    return (f"efficiency curve max_efficiency {calibration.max_efficiency:.3f}, half_efficiency_width "
            f"{calibration.half_efficiency_width:.0f}")


def _gain(gain: float | None) -> str:
    return "-" if gain is None else f"{100 * gain:+.1f}%"


def check_group(name: str, group: pf.Group, base: Calibration, leave_one_out: bool) -> bool:
    """Prints the group's table, rankings and gains; returns whether the rankings agree."""
    result = pf.check(group, base, leave_one_out)
    fitted = pf.fit([group], base)
    print(f"\n{name}: {_curve(fitted)}; activation_memory_factor {fitted.activation_memory_factor:.3f}; "
          "layer us per token: " + "; ".join(
              f"{key.describe()} {us:.3f}" for key, us in fitted.layer_forward_us_per_token.items()))
    print("| layout | measured tokens/s | rank | predicted tokens/s | error | rank | measured GB | predicted GB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for run, p in sorted(result.rows, key=lambda rp: -(rp[0].tokens_per_s or 0)):
        m_rank = result.measured.index(run.label) + 1 if run.label in result.measured else "OOM"
        p_rank = result.predicted.index(run.label) + 1 if run.label in result.predicted else "over memory"
        m_tok = f"{run.tokens_per_s:,.0f}" if run.tokens_per_s else "-"
        error = f"{100 * (p.tokens_per_s / run.tokens_per_s - 1):+.1f}%" if run.tokens_per_s else "-"
        m_gb = f"{run.peak_gb * pf.GIB:.1f}" if run.peak_gb else "-"
        print(f"| {run.label} | {m_tok} | {m_rank} | {p.tokens_per_s:,.0f} | {error} | {p_rank} | {m_gb} "
              f"| {p.memory_gb:.1f} |")
    apart = ("" if None in (result.measured_gain, result.predicted_gain)
             else f" ({100 * abs(result.predicted_gain - result.measured_gain):.1f} points apart)")
    print(f"best heterogeneous over best homogeneous: predicted {_gain(result.predicted_gain)}, measured "
          f"{_gain(result.measured_gain)}{apart}")
    print(f"rankings {'agree' if result.agree else 'DISAGREE'}")
    return result.agree


def check_curve(groups: list[pf.Group], base: Calibration) -> Calibration:
    """Prints the curve fitted to every group and each measured shape predicted without it;
    returns the calibration fitted to every group."""
    fitted = pf.fit(groups, base)
    seen = [o for group in groups for o in pf.observations(group)]
    print(f"\nevery group: {_curve(fitted)}; each measured layer shape predicted from the curve fitted "
          f"without it (CP shapes: the curve and the modeled K/V exchange; the curve is fitted without CP)")
    print("| layer shape and layout | runs | measured us per token | curve without it: time vs measured |")
    print("| --- | --- | --- | --- |")
    for key, error in pf.left_out_errors(seen, base).items():
        runs = sum(o.key == key for o in seen)
        print(f"| {key.describe()} | {runs} | {fitted.layer_forward_us_per_token[key]:.3f} | {100 * error:+.1f}% |")
    return fitted


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="bench_e2e JSON lines (later files replace earlier runs)")
    parser.add_argument("--oom", nargs="*", default=[], metavar="WORKLOAD:LAYERS:LAYOUT[:FLAGS]")
    parser.add_argument("--calibration", default=str(DEFAULT_CALIBRATION))
    parser.add_argument("--leave-one-out", action="store_true")
    parser.add_argument("--write-calibration", metavar="FILE", help="the calibration fitted to every group")
    parser.add_argument("--memory", action="store_true", help="check the memory model against one-GPU records")
    opts = parser.parse_args(argv)
    try:
        if opts.memory:
            return check_memory([Path(path) for path in opts.results])
        base = Calibration.load(opts.calibration)
        records = [json.loads(line) for path in opts.results for line in open(path) if line.strip()]
        groups = pf.measured_groups(records, LAYOUTS, trainer_vocab_size())
        add_oom_runs(groups, opts.oom)
        all_agree = True
        for key, group in groups.items():
            all_agree &= check_group(key.describe(), group, base, opts.leave_one_out)
        fitted = check_curve(list(groups.values()), base)
    except (OSError, ValueError, LayoutError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if opts.write_calibration:
        Path(opts.write_calibration).write_text(json.dumps(fitted.to_dict(), indent=2) + "\n")
    return 0 if all_agree else 1


def check_memory(paths: list[Path]) -> int:
    """Prints every band record's measured and predicted peak (GB) and the factors the records fit;
    returns 1 where a record is out of the band."""
    records = pf.band_records(paths, LAYOUTS)
    print("| record | workload, LLM layers | layout | GPU | kernels (vision, llm) | measured GB | predicted GB "
          "| error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    outside, groups = 0, []
    for path, record in records:
        calibration = Calibration.measured(pf.record_gpu(record))
        run, predicted = pf.predict_record_memory(record, LAYOUTS, calibration)
        measured = record["peak_gb_max"] * pf.GIB
        inside = pf.in_memory_band(predicted, measured)
        outside += not inside
        kernels = ", ".join(f"{kernel} {dim}" for _, kernel, dim in run.attention)
        kernels += ", fused MLP" if run.fused_mlp else ""
        kernels += " (the encoder's too)" if run.fused_mlp and run.fused_gated_bias_mlp else ""
        kernels += ", fused cross entropy" if run.fused_cross_entropy else ""
        kernels += " (quack's)" if run.fused_cross_entropy and run.quack_loss else ""
        print(f"| {path} | {record['workload']}, {record['llm_layers']} | {run.label} | {pf.record_gpu(record)} "
              f"| {kernels} | {measured:.1f} | {predicted:.1f} | {predicted - measured:+.1f}"
              f"{'' if inside else ' (outside)'} |")
        (group,) = pf.measured_groups([record], LAYOUTS, trainer_vocab_size()).values()
        groups.append(replace(group, runs=(run,)))
    fitted = pf.memory_factors(groups, Calibration.load(str(DEFAULT_CALIBRATION)), True, pf.MEMORY_MARGIN)
    print(f"\n{len(records)} records, {outside} outside the band; the factors they fit (peak x "
          f"{1 + pf.MEMORY_MARGIN:g}): "
          + json.dumps({key: round(value, 3) for key, value in fitted.activation_memory_factors.items()}))
    return 1 if outside else 0


def add_oom_runs(groups: dict, oom: list[str]) -> None:
    """The named out-of-memory runs into their groups (at the group's first micro batch size; of a
    workload measured at several memory sizes, the smallest's: where memory ran out)."""
    for item in oom:
        parts = item.split(":")
        if len(parts) not in (3, 4) or not parts[1].isdigit():
            raise ValueError(f"--oom {item}: write workload:LLM layers:layout[:flags], e.g. W2:8:gpu2_homogeneous_dp2")
        workload, layers, layout, flags = (*parts, "")[:4]
        key = min((k for k in groups if (k.workload, k.layers) == (workload, int(layers))), key=lambda k: k.memory_gb,
                  default=None)
        if key is None:
            raise ValueError(f"--oom {item}: no measured run of {workload} with {layers} LLM layers to compare with")
        group = groups[key]
        flags = tuple(flags.split(",")) if flags else ()
        name = layout + (f" [{' '.join(flags)}]" if flags else "")
        run = pf.Run(name, load_layout(str(LAYOUTS / f"{layout}.yaml"), key.gpus), group.runs[0].micro_batch,
                  None, None, {}, flags, group.runs[0].weight_bytes)
        groups[key] = replace(group, runs=(*group.runs, run))


if __name__ == "__main__":
    sys.exit(main())
