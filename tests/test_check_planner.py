"""The calibration fit (tools/planner_fit.py) recovers a known calibration from run phases the
cost model itself produced; fitted without one measured layer shape, the efficiency curve predicts
that shape's measured runs; tools/check_planner.py ranks the measured 2x H200 runs
(docs/runs/bench_e2e/results.jsonl) as the planner predicts; on W5 (docs/runs/gpu2/, issue 28) the
planner's gain of the best heterogeneous layout over the best homogeneous one, which needs block
recomputation, lands within 10 points of the measured gain."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
from planner_fit import (
    GIB,
    Group,
    Run,
    check,
    fit,
    left_out_errors,
    measured_groups,
    observations,
    predict_run,
    record_run,
)

from megatron_hetero.planner import (
    BENCH_WORKLOADS,
    H200_MEMORY_GB,
    PRESETS,
    Calibration,
    Cluster,
    CostModel,
    plan,
    trainer_workload,
)
from megatron_hetero.planner.calibration import CALIBRATIONS, LayerKey
from megatron_hetero.planner.counts import layer_forward_flops_per_token
from megatron_hetero.planner.presets import FAMILY_BENCH_WORKLOADS, trainer_vocab_size
from megatron_hetero.planner.shapes import H100_MEMORY_GB
from megatron_hetero.spec.layout import load_layout
from tests.tool_cli import run_tool

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "runs" / "bench_e2e" / "results.jsonl"
LAYOUTS = ROOT / "examples" / "layouts"
GPU2 = ROOT / "docs" / "runs" / "gpu2"
# Call 5b's DP2 with 1 of 12 layers recomputed ran out of memory (docs/runs/benchmarks.md): no record.
BLOCK_1 = ("--use-distributed-optimizer", "--recompute-granularity", "full", "--recompute-method", "block",
           "--recompute-num-layers", "1")


def read_records(*paths: Path) -> list[dict]:
    """bench_e2e's records (JSON lines) of these files, in order."""
    return [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]


def w5_group() -> Group:
    """W5's 2-GPU runs (every call, the newest record of each layout and flags) and the OOM run."""
    files = sorted(GPU2.glob("*/bench_e2e*.jsonl")) + [GPU2 / "baselines" / "w1_colocated.jsonl"]
    records = read_records(*files)
    (group,) = [g for key, g in measured_groups(records, LAYOUTS, trainer_vocab_size()).items() if key[0] == "W5"]
    layout = load_layout(str(LAYOUTS / "gpu2_homogeneous_dp2.yaml"), 2)
    oom = Run("gpu2_homogeneous_dp2 [" + " ".join(BLOCK_1) + "]", layout, 1, None, None, {}, BLOCK_1)
    return replace(group, runs=(*group.runs, oom))


def test_fit_recovers_the_calibration_that_made_the_phases():
    w = replace(BENCH_WORKLOADS["W1"], layers=8)
    workload = trainer_workload(w, 128, frozen_encoder=False)
    # Communication made free, so that each phase is compute on one efficiency curve.
    truth = Calibration(max_efficiency=0.55, half_efficiency_width=400, nvlink_gbps=1e12, p2p_gbps=1e12,
                        collective_latency_us=0.0, boundary_gbps=1e12, boundary_call_ms=0.0)
    model = CostModel(workload, Cluster(2, H200_MEMORY_GB), truth)
    shapes = {"encoder": workload.encoders[0], "llm": workload.llm}
    runs = []
    for name in ("gpu2_colocated", "gpu2_homogeneous_tp2", "gpu2_homogeneous_dp2", "gpu2_colocated_cp2",
                 "gpu2_non_colocated", "gpu2_colocated_pp2"):
        layout = load_layout(str(LAYOUTS / f"{name}.yaml"), 2)
        phases = {}
        for module in layout.modules:
            forward, backward = model.microbatch_pass(shapes[module.role], module, w.global_batch / module.dp, False)
            # The colocated schedule runs the encoder's forward twice when the LLM is pipelined.
            reruns = module.role == "encoder" and layout.llm.pp > 1
            phases[f"{module.role}-forward"] = forward.total * (2 if reruns else 1)
            phases[f"{module.role}-backward"] = backward.total
        runs.append(Run(name, layout, w.micro_batch, 1.0, None, phases))
    group = Group(workload, 2, runs)
    peaks = [predict_run(run, group, replace(truth, activation_memory_factor=1.3)).memory_gb / GIB for run in runs]
    group = replace(group, runs=[replace(run, peak_gb=peak) for run, peak in zip(runs, peaks)])

    # The fit starts from the truth's links (it subtracts their communication) but another curve.
    fitted = fit([group], replace(truth, max_efficiency=0.3, half_efficiency_width=256))
    assert fitted.max_efficiency == pytest.approx(0.55, rel=1e-6)
    assert fitted.half_efficiency_width == pytest.approx(400, rel=1e-6)
    assert fitted.activation_memory_factor == pytest.approx(1.3, rel=1e-6)
    vision, llm = workload.encoders[0], workload.llm
    keys = {LayerKey.of(llm, 2, 1), LayerKey.of(llm, 1, 1), LayerKey.of(llm, 1, 2), LayerKey.of(vision, 1, 1),
            LayerKey.of(vision, 2, 1)}
    assert set(fitted.layer_forward_us_per_token) == keys
    for key, us in fitted.layer_forward_us_per_token.items():
        shape = llm if key.role == "llm" else vision
        expected = layer_forward_flops_per_token(shape) / key.tp / (790e12 * model.efficiency(shape, key.tp))
        assert us == pytest.approx(1e6 * expected, rel=1e-6), key


def test_the_curve_predicts_each_measured_shape_left_out_of_its_fit():
    """Each layer shape and layout measured on 2x H200 without CP, left out of the curve's fit,
    predicted from the curve the other shapes give: within 10% of its measured times (the largest,
    the 7B LLM layer at TP1, -8.5%: the curve's one extrapolation to a wider GEMM)."""
    records = read_records(RESULTS)
    groups = measured_groups(records, LAYOUTS, trainer_vocab_size()).values()
    seen = [o for group in groups for o in observations(group)]
    errors = left_out_errors(seen, Calibration.load(str(CALIBRATIONS / "calibration_h200.json")))
    without_cp = {key: error for key, error in errors.items() if key.cp == 1}
    assert len(without_cp) == 5 and {key.role for key in without_cp} == {"encoder", "llm"}
    assert all(abs(error) <= 0.10 for error in without_cp.values()), errors


def test_measured_runs_rank_as_the_planner_predicts():
    result = run_tool("check_planner", RESULTS, "--oom", "W2:8:gpu2_homogeneous_dp2", "W1:16:gpu2_homogeneous_dp2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "DISAGREE" not in result.stdout and result.stdout.count("rankings agree") >= 4


def test_bad_oom_item_is_one_line():
    result = run_tool("check_planner", RESULTS, "--oom", "W9:8:gpu2_colocated")
    # Importing megatron-core may log a line of its own first (no CUDA here).
    last = result.stderr.splitlines()[-1]
    assert result.returncode == 2 and last.startswith("error: --oom W9:8:gpu2_colocated")


def test_memory_records_that_cannot_be_fitted_are_one_line():
    """--memory on records whose kernels never vary apart (one run's two arms) prints each run's error,
    then one line saying the factors cannot be told apart."""
    runs = ROOT / "docs" / "runs" / "h200_one_card" / "tree_step"
    result = run_tool("check_planner", "--memory", runs / "B.jsonl", runs / "C.jsonl")
    assert "| qwen2_5_vl_7b, 4 | single | h200 |" in result.stdout
    last = result.stderr.splitlines()[-1]
    assert result.returncode == 2 and last.startswith("error: activation memory factors"), result.stderr


def test_w5_ranking_and_gain_against_the_measured_runs():
    """Every measured W5 layout (DP2 at 3, 6, 9 and 12 recomputed layers, CP2, TP2+SP at 0, 3, 4 and 6)
    ranked as measured but for runs within 2% of each other (TP2+SP at 6 and DP2 at 9 are 1.4% apart,
    measured on two H200 pairs, and predicted 0.1% apart the other way), the OOM run predicted over
    memory, and the gain within 10 points."""
    result = check(w5_group(), Calibration.load(str(CALIBRATIONS / "calibration_h200.json")))
    assert result.largest_misranked_gap() <= 0.02, (result.measured, result.predicted)
    over = sorted(r.label for r, p in result.rows if not p.fits)
    assert over == sorted(r.label for r, _ in result.rows if r.tokens_per_s is None), over
    assert len(result.measured) >= 11
    assert abs(result.predicted_gain - result.measured_gain) <= 0.10, (result.predicted_gain, result.measured_gain)


def test_the_planner_predicts_the_w5_gain_within_10_points():
    """plan_layout's W5 (12 LLM layers, an H200's 150.1 GB, the shipped measured calibration): its best
    homogeneous layout recomputes some layers but not all, and its gain lands within 10 points of the
    measured gain of the best heterogeneous run over the best homogeneous one."""
    measured = check(w5_group(), Calibration.load(str(CALIBRATIONS / "calibration_h200.json"))).measured_gain
    workload = PRESETS["W5"].workload
    workload = replace(workload, llm=replace(workload.llm, layers=12))
    result = plan(workload, Cluster(2, 150.1), Calibration.load(str(CALIBRATIONS / "calibration_h200_measured.json")))
    homogeneous = result.best("homogeneous")
    best = next(p for p in result.ranked if p.candidate.placement != "homogeneous")
    assert homogeneous.candidate.recompute and not homogeneous.candidate.recompute.full
    predicted = homogeneous.step_s / best.step_s - 1
    assert abs(predicted - measured) <= 0.10, (predicted, measured)


@pytest.mark.parametrize("flags, kept", [("", True), ("--hetero-colocated-schedule recompute", True),
                                         ("--use-distributed-optimizer --hetero-colocated-schedule bubbles", False)])
def test_runs_under_another_schedule_are_not_fitted(flags, kept):
    """The planner models the recompute schedule: a run under another one, named in the record's
    layout or passed as the training script's flag, is left out of the fit."""
    layout = "gpu2_colocated_pp2" + (f" [{flags}]" if flags else "")
    record = dict(workload="W1", layout=layout, gpus=2, tokens_per_s=1.0, peak_gb_max=1.0, phases={})
    assert (record_run(record, LAYOUTS) is not None) == kept
    assert record_run(dict(record, layout="gpu2_colocated_pp2 (bubbles)"), LAYOUTS) is None


def test_runs_are_judged_against_their_own_gpus_memory():
    """A run on H100s (torch's 79.18 GiB), or under bench_e2e's 79.6 GiB cap, is grouped and judged
    at that memory, not at the H200's: W6's TP2+SP recomputing 9 of 12 layers, out of memory on the
    H100s (calls 18, 25), is predicted over memory there and to fit on an H200."""
    records = read_records(GPU2 / "w6_h100_pair" / "bench_e2e.jsonl")
    capped = [dict(r, device="NVIDIA H200", memory_cap_gib=79.6) for r in records]
    h200 = [dict(r, device="NVIDIA H200") for r in records]
    groups = measured_groups(records + capped + h200, LAYOUTS, trainer_vocab_size())
    assert sorted(key[4] for key in groups) == [H100_MEMORY_GB, round(79.6 * GIB, 1), H200_MEMORY_GB]
    # Records since bench_e2e wrote the GPU's memory are judged by it, whatever the GPU's name.
    nvl = [dict(r, device="NVIDIA H100 NVL", device_memory_gib=93.0) for r in records]
    assert [key[4] for key in measured_groups(nvl, LAYOUTS, trainer_vocab_size())] == [99.9]
    (group,) = [g for key, g in groups.items() if key[4] == H100_MEMORY_GB]
    flags = BLOCK_1[:-1] + ("9",)
    oom = Run("gpu2_colocated_sp [" + " ".join(flags) + "]", load_layout(str(LAYOUTS / "gpu2_colocated_sp.yaml"), 2),
              1, None, None, {}, flags)
    fitted = fit([group], Calibration.load(str(CALIBRATIONS / "calibration_h100_measured.json")))
    assert not predict_run(oom, group, fitted).fits
    assert predict_run(oom, replace(group, memory_gb=H200_MEMORY_GB), fitted).fits


def test_the_usable_memory_share_is_fitted_where_runs_ran_out():
    """W6 on the H100s (call 19, and call 18's TP2+SP recomputing 10 of 12 layers, out of memory):
    at the default 90% the planner has the failed run fit; fitted, the share separates it from the
    runs that ran, and without a failed run the calibration's own share stays."""
    records = read_records(GPU2 / "w6_h100_pair" / "bench_e2e.jsonl")
    (group,) = measured_groups(records, LAYOUTS, trainer_vocab_size()).values()
    base = Calibration.load(str(CALIBRATIONS / "calibration_h200.json"))
    assert fit([group], base).usable_memory_fraction == base.usable_memory_fraction == 0.9
    flags = BLOCK_1[:-1] + ("10",)
    oom = Run("gpu2_colocated_sp [" + " ".join(flags) + "]", load_layout(str(LAYOUTS / "gpu2_colocated_sp.yaml"), 2),
              1, None, None, {}, flags)
    with_oom = replace(group, runs=(*group.runs, oom))
    assert predict_run(oom, with_oom, fit([group], base)).fits  # the default share: predicted to fit
    fitted = fit([with_oom], base)
    assert fitted.usable_memory_fraction < 0.9
    assert not predict_run(oom, with_oom, fitted).fits
    assert all(predict_run(run, with_oom, fitted).fits for run in group.runs)


def test_a_fused_mlp_keeps_no_activation_output():
    """A dense MLP on quack's GEMM epilogues (models/mlp.py) keeps its fc1 output but not the
    activation's: ffn / TP fewer values per token and layer, the LLM's gated ones too; a gated encoder
    (fc1 biases) only where its layout passed its check (`fused_gated_bias_mlp`); expert MLPs and calls
    below MLP_MIN_MACS (auto leaves them to torch: W1's ViT at micro batch 1, 11,664 x 1152 x 4304 =
    2^35.8) as before. A record whose MLPs ran so (`mlp`, the encoder's apart) is predicted with it."""
    from megatron_hetero.planner.counts import activation_bytes_per_token_layer, mlp_runs_fused
    from megatron_hetero.spec.sizes import MLP_MIN_MACS

    llm, vit = PRESETS["W1"].workload.llm, PRESETS["W1"].workload.encoders[0]
    for tp, sp in ((1, False), (2, True)):
        for shape in (llm, replace(llm, gated_mlp=True)):
            plain, fused = (activation_bytes_per_token_layer(shape, tp, sp, 2, fused) for fused in (False, True))
            assert plain - fused == 2 * shape.ffn / tp
    large = MLP_MIN_MACS[0] // (llm.hidden * llm.ffn) + 1  # tokens: fc1's GEMM just over the minimum at TP1
    assert mlp_runs_fused(llm, large, 1, True) and not mlp_runs_fused(llm, large, 2, True)
    assert not mlp_runs_fused(llm, large, 1, False)
    for other in (replace(vit, gated_mlp=True), replace(llm, experts=4, topk=2)):
        assert not mlp_runs_fused(other, 10**9, 1, True)
    assert mlp_runs_fused(replace(vit, gated_mlp=True), 10**9, 1, True, fused_gated_bias=True)
    assert not mlp_runs_fused(replace(vit, gated_mlp=True), 10**9, 1, False, fused_gated_bias=True)
    assert not mlp_runs_fused(replace(llm, experts=4, topk=2), 10**9, 1, True, fused_gated_bias=True)
    assert vit.tokens_per_sample == 11_664
    assert [mlp_runs_fused(vit, samples * vit.tokens_per_sample, 1, True) for samples in (1, 2)] == [False, True]
    record = dict(workload="W1", layout="gpu2_colocated", gpus=2, tokens_per_s=1.0, peak_gb_max=1.0, phases={})
    runs = [record_run(dict(record, mlp={"vision": kernel, "llm": kernel}), LAYOUTS)
            for kernel in ("torch (no GPU)", "quack (gelu_erf)")]
    assert [run.fused_mlp for run in runs] == [False, True]
    workload = PRESETS["W1"].workload
    models = [CostModel(run.workload(workload), Cluster(2, 141.0), Calibration()) for run in runs]
    llm = [model.activation_bytes(workload.llm, runs[0].layout.llm, 1, 0) for model in models]
    assert llm[1] < llm[0]
    # The ViT's call at one sample is below the minimum: the same bytes fused or not; at two, fewer.
    vision = runs[0].layout.module("vision")
    vit_bytes = [[model.activation_bytes(vit, vision, samples, 0) for samples in (1, 2)] for model in models]
    assert vit_bytes[1][0] == vit_bytes[0][0] and vit_bytes[1][1] < vit_bytes[0][1]
    # Qwen2.5-VL's gated ViT with fc1 biases: fused where the record's vision MLP ran on quack
    gated = replace(vit, gated_mlp=True)
    kernels = [("quack (swiglu)", "torch (a gated MLP with fc1 biases)"), ("quack (swiglu)", "quack (swiglu)")]
    runs = [record_run(dict(record, mlp={"llm": llm_kernel, "vision": vision_kernel}), LAYOUTS)
            for llm_kernel, vision_kernel in kernels]
    assert [(run.fused_mlp, run.fused_gated_bias_mlp) for run in runs] == [(True, False), (True, True)]
    models = [CostModel(run.workload(replace(workload, encoders=(gated,))), Cluster(2, 141.0), Calibration())
              for run in runs]
    plain, fused = (model.activation_bytes(gated, vision, 2, 0) for model in models)
    layer_tokens = 2 * vit.tokens_per_sample * vit.layers  # the GPU's 2 samples' tokens, every layer
    assert plain - fused == pytest.approx(layer_tokens * 2 * vit.ffn * models[0]._factor(gated))  # bf16 ffn


def test_runs_of_other_sequences_or_images_form_groups_of_their_own():
    """A record's sequence length and images per sample (bench_e2e's overrides) are part of its
    workload: the same preset at 32K with 32 images is another group than at 8K with 8, planned with
    that workload (a family's own vocabulary), and records from before the fields are the preset's."""
    records = read_records(ROOT / "docs" / "runs" / "gpu4" / "qwen2_5_vl_7b_32k" / "bench_e2e.jsonl")
    short = [{k: v for k, v in r.items() if k not in ("seq_length", "items_per_sample")} for r in records]
    groups = measured_groups(records + short, LAYOUTS, trainer_vocab_size())
    assert sorted((key.seq_length, key.items_per_sample) for key in groups) == [(8192, 8), (32768, 32)]
    long = next(g for key, g in groups.items() if key.seq_length == 32768)
    assert long.workload.llm.seq_length == 32768 and long.workload.encoders[0].items_per_sample == 32
    assert long.workload.llm.vocab == trainer_vocab_size(FAMILY_BENCH_WORKLOADS["qwen2_5_vl_7b"])
    key = next(k for k in groups if k.seq_length == 32768)
    assert key.describe().endswith("global batch 2, 32768 tokens, 32 images per sample")
