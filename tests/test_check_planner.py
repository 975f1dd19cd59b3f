"""The calibration fit (megatron_hetero.planner.fit) recovers a known calibration from run phases the
cost model itself produced; tools/check_planner.py ranks the measured 2x H200 runs
(docs/runs/bench_e2e/results.jsonl) as the planner predicts; measured layer times keyed by TP and
CP sizes round-trip through JSON."""

from dataclasses import replace
from pathlib import Path

import pytest

from megatron_hetero.layout import load_layout
from megatron_hetero.planner import BENCH_WORKLOADS, H200_MEMORY_GB, Calibration, Cluster, CostModel, trainer_workload
from megatron_hetero.planner.counts import layer_forward_flops_per_token
from megatron_hetero.planner.fit import GIB, Run, fit, predict_run
from tests.tool_cli import run_tool

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "runs" / "bench_e2e" / "results.jsonl"
LAYOUTS = ROOT / "examples" / "layouts"


def test_fit_recovers_the_calibration_that_made_the_phases():
    w = replace(BENCH_WORKLOADS["W1"], layers=8)
    workload = trainer_workload(w, 128, frozen_encoder=False)
    # Communication made free, so that each phase is compute at one efficiency curve.
    truth = Calibration(max_efficiency=0.55, nvlink_gbps=1e12, p2p_gbps=1e12, collective_latency_us=0.0,
                        boundary_gbps=1e12, boundary_call_ms=0.0)
    model = CostModel(workload, Cluster(2, H200_MEMORY_GB), truth)
    shapes = {"encoder": workload.encoders[0], "llm": workload.llm}
    runs = []
    for name in ("gpu2_colocated", "gpu2_homogeneous_tp2", "gpu2_homogeneous_dp2", "gpu2_colocated_cp2",
                 "gpu2_non_colocated"):
        layout = load_layout(str(LAYOUTS / f"{name}.yaml"), 2)
        phases = {}
        for module in layout.modules:
            forward, backward = model.microbatch_pass(shapes[module.role], module, w.global_batch / module.dp, False)
            phases[f"{module.role}-forward"], phases[f"{module.role}-backward"] = forward.total, backward.total
        run = Run(name, layout, w.micro_batch, 1.0, None, phases)
        peak = predict_run(run, workload, 2, replace(truth, activation_memory_factor=1.3)).memory_gb / GIB
        runs.append(replace(run, peak_gb=peak))

    fitted = fit(runs, workload, 2, Calibration())
    assert fitted.max_efficiency == pytest.approx(0.55, rel=1e-6)
    assert fitted.activation_memory_factor == pytest.approx(1.3, rel=1e-6)
    keys = {"llm": {(2, 1), (1, 1), (1, 2)}, "vision": {(1, 1), (2, 1)}}
    assert {name: set(times) for name, times in fitted.layer_forward_us_per_token.items()} == keys
    for name, times in fitted.layer_forward_us_per_token.items():
        shape = workload.llm if name == "llm" else workload.encoders[0]
        for (tp, cp), us in times.items():
            expected = layer_forward_flops_per_token(shape) / tp / (790e12 * model.efficiency(shape, tp))
            assert us == pytest.approx(1e6 * expected, rel=1e-6), (name, tp, cp)


def test_measured_runs_rank_as_the_planner_predicts():
    result = run_tool("check_planner", RESULTS, "--oom", "W2:8:gpu2_homogeneous_dp2", "W1:16:gpu2_homogeneous_dp2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "DISAGREE" not in result.stdout and result.stdout.count("rankings agree") >= 4


def test_bad_oom_item_is_one_line():
    result = run_tool("check_planner", RESULTS, "--oom", "W9:8:gpu2_colocated")
    assert result.returncode == 2 and result.stderr.startswith("error: --oom W9:8:gpu2_colocated")


def test_layer_times_keyed_by_tp_and_cp_round_trip():
    calibration = Calibration.from_dict({"layer_forward_us_per_token": {"llm": {"2": 0.6, "tp1cp2": 1.4}}})
    assert calibration.layer_forward_us_per_token == {"llm": {(2, 1): 0.6, (1, 2): 1.4}}
    assert Calibration.from_dict(calibration.to_dict()) == calibration
    with pytest.raises(ValueError, match="tp1cp2"):
        Calibration.from_dict({"layer_forward_us_per_token": {"llm": {"tp1cpx": 1.0}}})
