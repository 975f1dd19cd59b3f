"""The layout planner's cost model (pure, no processes): FLOP and parameter counts by hand,
enumeration against the layout rules, memory exclusion, the written layout file, monotonic sanity,
the default calibration against its one measurement, the grouped MoE experts' transient against
the tensors their backward builds on the CPU, and the CLI."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from megatron_hetero import layout as layout_cli
from megatron_hetero.planner import (
    PRESETS,
    Calibration,
    Candidate,
    Cluster,
    CostModel,
    ModuleShape,
    Workload,
    best_micro_batch,
    candidate_from_layout,
    enumerate_candidates,
    explain,
    layout_problem,
    layout_yaml,
    model_flops_per_step,
    module_forward_flops_per_sample,
    plan,
)
from megatron_hetero.planner.calibration import CALIBRATIONS, LayerKey
from megatron_hetero.planner.candidates import Recompute, encoder_batchings, encoder_layouts
from megatron_hetero.planner.counts import (
    FUSED_LOGIT_BYTES,
    LOGIT_BYTES,
    QKV_VIEW_COPIES,
    QUACK_LOGIT_BYTES,
    activation_bytes_per_token_layer,
    bytes_per_logit,
    grouped_experts_transient_bytes,
    layer_forward_flops_per_token,
    layer_params,
    packed_sdpa_copies,
    window_lengths,
)
from megatron_hetero.planner.families import FAMILY_BENCHES
from megatron_hetero.spec.layout import AXES, ModuleLayout, load_layout, parse_layout
from tests.tool_cli import run_tool

ROOT = Path(__file__).resolve().parents[1]
W1 = PRESETS["W1"].workload


def tiny_workload(frozen=False):
    llm = ModuleShape("llm", "llm", hidden=4, layers=1, heads=2, ffn=8, seq_length=6, vocab=10)
    vision = ModuleShape("vision", "encoder", hidden=4, layers=2, heads=1, ffn=8, tokens_per_item=4,
                         items_per_sample=1, output_tokens_per_item=2, projector_ffn=6, frozen=frozen)
    return Workload((vision,), llm, global_batch=3)


def test_encoder_cp_splits_its_tokens_work_and_activations():
    """An encoder's CP ranks each run 1/cp of every item's tokens (each query still over the whole
    item: the attention's FLOPs split with them), gather its keys and values, and keep 1/cp of its
    activations; replicas (cp_replicated) keep the whole item's. The planner lists encoder CP where it
    divides the items' tokens."""
    workload = tiny_workload()
    vision = workload.encoders[0]
    model = CostModel(workload, Cluster(4, 150), Calibration())
    whole, split = ModuleLayout("vision", "encoder"), ModuleLayout("vision", "encoder", cp=2)
    replicas = replace(split, cp_replicated=True)
    assert model.activation_bytes(vision, split, 4, 0) == model.activation_bytes(vision, whole, 4, 0) / 2
    assert model.activation_bytes(vision, replicas, 4, 0) == model.activation_bytes(vision, whole, 4, 0)
    (forward, _), (forward_cp, _) = (model.microbatch_pass(vision, layout, 4, 0) for layout in (whole, split))
    assert forward_cp.compute == pytest.approx(forward.compute / 2, rel=1e-12)  # the projector's rows split too
    assert forward_cp.cp_comm > 0 == forward.cp_comm
    cps = {layout.cp for layout in encoder_layouts(vision, 4, 0, Cluster(4, 150), "colocated")}
    assert cps == {1, 2, 4}  # 4 tokens an item
    assert {layout.cp for layout in encoder_layouts(replace(vision, tokens_per_item=3, output_tokens_per_item=0), 4,
                                                    0, Cluster(4, 150), "colocated")} == {1}


def test_flops_match_a_hand_count():
    workload = tiny_workload(frozen=True)
    vision, llm = workload.encoders[0], workload.llm
    # One LLM layer: Q and O 4x4 each, K and V 4x4 each (MHA), MLP 2 x 4x8 = 32 + 32 + 64 = 128 weights.
    # Per token: 2 x 128 + attention 4 x (6 / 2 causal keys) x 4 = 256 + 48 = 304; per sample 6 tokens,
    # plus the output layer 2 x 4 x 10 per token.
    assert module_forward_flops_per_sample(llm, llm_hidden=4) == 6 * 304 + 6 * 2 * 4 * 10
    # Vision: 2 layers of 128 weights; per token 256 + 4 x 4 (whole item) x 4 = 320; 4 tokens per sample.
    # Projector: pixel shuffle merges 2 tokens, so its input is 8 wide: 8x6 + 6x4 = 72 weights,
    # 2 x 72 FLOPs on each of 2 rows.
    assert module_forward_flops_per_sample(vision, llm_hidden=4) == 2 * 320 * 4 + 2 * 72 * 2
    # A step: the LLM forward + backward (3x), the frozen encoder forward only, for 3 samples.
    assert model_flops_per_step(workload) == 3 * (3 * 2304 + 1 * 2848)


def test_grouped_query_attention_and_gated_mlp_weights():
    shape = ModuleShape("llm", "llm", hidden=8, layers=1, heads=4, kv_heads=2, ffn=16, gated_mlp=True,
                        seq_length=8, vocab=1)
    # Q, O: 8x8 each; K, V: 8 x (2 heads x 2 wide) each; MLP 3 x 8x16.
    assert shape.kv_dim == 4
    assert layer_params(shape) == 2 * 64 + 2 * 8 * 4 + 3 * 8 * 16


@pytest.mark.parametrize("gpus", [2, 8])
def test_enumeration_yields_only_valid_layouts_and_the_homogeneous_baseline(gpus):
    cluster = Cluster(gpus, 150)
    shapes = {s.name: s for s in W1.modules}
    placements = set()
    for group in enumerate_candidates(W1, cluster):
        for candidate in group:
            placements.add(candidate.placement)
            llm_dp = candidate.llm.dp
            # The trainer's batch rule: micro batch x llm dp divides the global batch (encoders take
            # the microbatch's images by cost, whatever their dp).
            assert W1.global_batch % (candidate.micro_batch * llm_dp) == 0
            for layout in candidate.layouts:
                assert layout_problem(shapes[layout.name], layout, candidate.placement, cluster) is None
            if candidate.placement == "homogeneous":
                encoder, llm = candidate.layouts
                assert (encoder.tp, encoder.cp, encoder.dp, encoder.pp) == (llm.tp, llm.cp, llm.dp, 1)
            else:
                # Every other candidate is a layout megatron_hetero.layout accepts.
                assert candidate.hetero_layout(gpus).world_size == gpus
                if candidate.placement == "colocated":
                    assert all(m.size == gpus for m in candidate.layouts)
                else:
                    assert sum(m.size for m in candidate.layouts) == gpus
    assert placements == {"homogeneous", "colocated", "non_colocated"}


def test_layout_rules_refuse_what_the_trainer_refuses():
    cluster = Cluster(16, 150)
    vision, llm = W1.encoders[0], W1.llm
    assert "heads" in layout_problem(vision, ModuleLayout("vision", "encoder", tp=3), "colocated", cluster)
    assert "layers" in layout_problem(llm, ModuleLayout("llm", "llm", pp=3), "colocated", cluster)
    encoder_cp2, encoder_pp3 = ModuleLayout("vision", "encoder", cp=2), ModuleLayout("vision", "encoder", pp=3)
    # an encoder's CP splits an item's 729 tokens: by 3, not by 2; replicas (the baseline's) need not
    assert "cp=2 does not divide an item's 729 encoder tokens" in layout_problem(vision, encoder_cp2, "colocated",
                                                                                 cluster)
    assert layout_problem(vision, replace(encoder_cp2, cp=3), "non_colocated", cluster) is None
    replicated = replace(encoder_cp2, cp_replicated=True)
    assert layout_problem(vision, replicated, "homogeneous", cluster) is None  # replicated over the LLM's CP
    internvl = replace(vision, tokens_per_item=1024, cp_split="none")  # InternViT: never split
    assert "which this model's vision encoder does not" in layout_problem(internvl, encoder_cp2, "colocated", cluster)
    qwen = replace(vision, cp_split="blocks")  # a Qwen tower: whole merge blocks, any item size
    assert layout_problem(qwen, encoder_cp2, "colocated", cluster) is None
    assert "encoder runs unpipelined" in layout_problem(vision, encoder_pp3, "colocated", cluster)
    assert layout_problem(vision, encoder_pp3, "non_colocated", cluster) is None
    assert "node" in layout_problem(llm, ModuleLayout("llm", "llm", tp=16), "colocated", cluster)
    odd = replace(llm, seq_length=16386)
    assert "chunks" in layout_problem(odd, ModuleLayout("llm", "llm", cp=2), "colocated", cluster)


def test_a_layout_file_that_is_megatrons_layout_is_predicted_as_homogeneous():
    """A colocated file whose encoders take the LLM's TP and DP (replicated over its CP, on the
    first of its PP stages) is the homogeneous baseline, as enumerate_candidates lists it; any other
    colocated file is not."""
    cluster = Cluster(2, 150)
    names = ("gpu2_homogeneous_tp2", "gpu2_homogeneous_dp2", "gpu2_homogeneous_cp2", "gpu2_homogeneous_pp2_stacked",
             "gpu2_colocated", "gpu2_colocated_cp2", "gpu2_colocated_pp2")
    placements = {name: {c.placement for c in candidate_from_layout(load_layout(ROOT / "examples" / "layouts" /
                                                                                 f"{name}.yaml", 2), W1, cluster)}
                  for name in names}
    assert placements == {**{name: {"homogeneous"} for name in names[:4]},
                          **{name: {"colocated"} for name in names[4:]}}


def test_a_batched_encoder_on_megatrons_layout_is_colocated():
    """An encoder at the LLM's TP and DP but run once per k microbatches (`microbatches: k`) is not
    Megatron's layout (it has no pass over several): the file is colocated and predicted at k
    microbatches' work a pass, k times fewer passes, at or under the GPU's ceiling."""
    cluster = Cluster(1, 150)
    workload = replace(W1, global_batch=4, micro_batch=1)
    model = CostModel(workload, cluster, Calibration())

    def layout(k):
        return parse_layout({"placement": "colocated", "modules": {"vision": {"role": "encoder", "microbatches": k},
                                                                   "llm": {"role": "llm"}}}, 1)

    (one,), (four,) = (candidate_from_layout(layout(k), workload, cluster) for k in (1, 4))
    assert (one.placement, four.placement) == ("homogeneous", "colocated")
    assert model.encoder_samples(four, four.encoders[0]) == 4 * model.encoder_samples(one, one.encoders[0])
    each, batched = model.predict(one), model.predict(four)
    assert batched.busy["vision"].compute == pytest.approx(each.busy["vision"].compute, rel=0.05)
    assert batched.tflops_per_gpu <= Calibration().matmul_tflops
    assert batched.memory_gb > each.memory_gb  # four microbatches' encoder activations at once


@pytest.mark.parametrize("name, llm", [("gpu2_homogeneous_pp2_stacked", dict(pp=2)),
                                       ("gpu2_homogeneous_cp2", dict(cp=2))])
def test_the_homogeneous_prediction_is_the_example_layout(name, llm):
    """Megatron's layout under LLM PP2 (the encoder on the first stage) or CP2 (replicated over
    it) as the planner enumerates it on 2 GPUs: its layout file is the example's, and the example
    read as a layout file is the same candidates with the same predictions."""
    workload, cluster = PRESETS["W5"].workload, Cluster(2, 150)
    model = CostModel(workload, cluster, Calibration())
    (listed,) = [group for group in enumerate_candidates(workload, cluster) if group
                 and group[0].placement == "homogeneous" and all(getattr(group[0].llm, k) == v for k, v in llm.items())]
    example = load_layout(ROOT / "examples" / "layouts" / f"{name}.yaml", 2)
    written = parse_layout(yaml.safe_load(layout_yaml(model.predict(listed[0]), workload, cluster)), 2)
    assert written == example
    from_file = candidate_from_layout(example, workload, cluster)
    assert from_file == listed
    assert [model.predict(c).step_s for c in from_file] == [model.predict(c).step_s for c in listed]


def test_layouts_over_memory_are_excluded():
    roomy = plan(W1, Cluster(8, 1000), Calibration())
    tight = plan(W1, Cluster(8, 150), Calibration())
    capacity = 150 * Calibration().usable_memory_fraction
    assert all(p.memory_gb <= capacity and p.fits for p in tight.ranked)
    assert all(p.memory_gb > capacity and not p.fits for p in tight.over_memory)
    assert tight.over_memory and len(tight.ranked) < len(roomy.ranked)
    assert not plan(W1, Cluster(8, 1), Calibration()).ranked


def test_best_layout_file_parses_and_matches(tmp_path, capsys):
    for name, gpus in (("W1", 8), ("W3", 8)):
        workload = PRESETS[name].workload
        cluster = Cluster(gpus, 150)
        result = plan(workload, cluster, Calibration())
        for best in (result.best("colocated"), result.best("non_colocated")):
            path = tmp_path / f"{name}_{best.candidate.placement}.yaml"
            path.write_text(layout_yaml(best, workload, cluster))
            loaded = load_layout(str(path), gpus)
            assert loaded.placement == best.candidate.placement
            for module, planned in zip(loaded.modules, best.candidate.layouts):
                assert module.name == planned.name
                assert [getattr(module, a) for a in (*AXES, "sp", "freeze")] == \
                       [getattr(planned, a) for a in (*AXES, "sp", "freeze")]
                assert module.ranks == planned.ranks or best.candidate.placement == "colocated"
            assert parse_layout(yaml.safe_load(path.read_text()), gpus) == loaded
            assert layout_cli.main(["check", str(path), "--world-size", str(gpus)]) == 0
    capsys.readouterr()


def _faster(calibration: Calibration, **changes) -> Calibration:
    return replace(calibration, **{k: getattr(calibration, k) * v for k, v in changes.items()})


def test_more_bandwidth_or_compute_never_predicts_slower():
    base = Calibration()
    faster = {
        "links": _faster(base, nvlink_gbps=2, p2p_gbps=2, network_gbps=2, boundary_gbps=2),
        "network": _faster(base, network_gbps=4),
        "compute": _faster(base, matmul_tflops=1.5),
    }
    for workload, gpus in ((W1, 8), (PRESETS["W2"].workload, 4), (PRESETS["W3"].workload, 16)):
        cluster = Cluster(gpus, 150, gpus_per_node=4)
        slow = CostModel(workload, cluster, base)
        quick = {k: CostModel(workload, cluster, c) for k, c in faster.items()}
        for group in enumerate_candidates(workload, cluster):
            for candidate in group:
                before = slow.predict(candidate).step_s
                for model in quick.values():
                    assert model.predict(candidate).step_s <= before * (1 + 1e-12)


def test_pipeline_bubble_and_imbalance():
    model = CostModel(W1, Cluster(8, 1000), Calibration())
    llm = ModuleLayout("llm", "llm", tp=2, pp=4, sp=True)
    # Colocated LLM pp4, 1F1B with m microbatches: the LLM GPUs wait (pp - 1) stages.
    colocated = model.predict(Candidate("colocated", (ModuleLayout("vision", "encoder", dp=8), llm), 8))
    stage = colocated.stage_s["llm"]
    assert colocated.idle_s == pytest.approx(3 * stage)
    # Homogeneous: the encoder on the first stage slows every microbatch's pace.
    homogeneous = model.predict(Candidate("homogeneous", (ModuleLayout("vision", "encoder", tp=2), llm), 8))
    assert homogeneous.stage_s["first stage"] > homogeneous.stage_s["llm"]
    m = W1.global_batch // 8
    first, rest = homogeneous.stage_s["first stage"], homogeneous.stage_s["llm"]
    assert homogeneous.idle_s == pytest.approx(first + 3 * rest + (m - 1) * first - m * first)


def test_recompute_trades_time_for_memory():
    """Each layer recomputed (Megatron's block method) costs its forward once more and frees its
    activations but its input; full recomputation (every layer, uniform) is the last, slowest step. With
    every layer recomputed no layer's activations wait for the loss: during its backward a layer holds them
    rebuilt and about as many bytes of their gradients, after the loss has freed the logits, so what it
    holds counts only beyond them."""
    workload = replace(W1, allow_recompute=True)
    model = CostModel(workload, Cluster(2, 150), Calibration())
    layouts = (ModuleLayout("vision", "encoder", dp=2), ModuleLayout("llm", "llm", tp=2, sp=True))
    of = workload.llm.layers
    steps = [model.predict(Candidate("colocated", layouts, 2, Recompute(k, of) if k else None)) for k in range(of + 1)]
    assert all(a.step_s < b.step_s for a, b in zip(steps, steps[1:]))
    assert all(a.memory_gb > b.memory_gb for a, b in zip(steps, steps[1:]))
    llm_shape, llm = workload.llm, layouts[1]
    logits = model.logit_bytes(llm_shape, llm, 2)
    layer = (model.activation_bytes(llm_shape, llm, 2, 0) - logits) / of  # one layer's, factor included
    assert model.activation_bytes(llm_shape, llm, 2, of) - logits == pytest.approx(
        2 * llm_shape.seq_length * llm_shape.hidden * 2 / llm.tp * of * Calibration().activation_factor("llm", "sdpa"))
    assert model.backward_bytes(llm_shape, llm, 2, of) == pytest.approx(2 * layer)
    assert model.backward_bytes(llm_shape, llm, 2, of - 1) == 0
    assert model.beyond_logits(2 * layer, llm, 2) == max(0.0, 2 * layer - logits)
    # The LLM's layers (and the encoder's first ones) each cost one layer's forward more.
    llm_layer = (steps[1].busy["llm"].total - steps[0].busy["llm"].total)
    assert steps[2].busy["llm"].total - steps[1].busy["llm"].total == pytest.approx(llm_layer)


def test_the_fewest_recomputed_layers_that_fit_are_chosen():
    workload = replace(W1, allow_recompute=True)
    layouts = (ModuleLayout("vision", "encoder", dp=2), ModuleLayout("llm", "llm", tp=2, sp=True))
    of = workload.llm.layers
    full = CostModel(workload, Cluster(2, 150), Calibration()).predict(Candidate("colocated", layouts, 2,
                                                                                   Recompute(of, of)))
    plain = CostModel(workload, Cluster(2, 150), Calibration()).predict(Candidate("colocated", layouts, 2))
    # A GPU whose memory lies between full recomputation's and none's: some layers must recompute.
    cluster = Cluster(2, (full.memory_gb + plain.memory_gb) / 2 / Calibration().usable_memory_fraction)
    model = CostModel(workload, cluster, Calibration())
    chosen = best_micro_batch(model, [Candidate("colocated", layouts, 2, r) for r in (None, Recompute(of, of))])
    k = chosen.candidate.recompute.layers
    assert chosen.fits and 1 < k < of
    assert not model.predict(replace(chosen.candidate, recompute=Recompute(k - 1, of))).fits
    assert chosen.candidate.describe().endswith(f"(recompute {k}/{of} layers)")
    header = layout_yaml(chosen, workload, cluster)
    assert f"--recompute-granularity full --recompute-method block --recompute-num-layers {k}" in header
    assert Recompute(of, of).flags().endswith("--recompute-method uniform --recompute-num-layers 1")


def test_default_calibration_reproduces_its_measured_anchor():
    """megatron-core GPTModel TP2 (local spec), 8 layers, hidden 4096, seq 4096, batch 1, on
    2x H200: 113 ms per forward + backward (ANCHORS.md). The shipped max_efficiency is fitted to it."""
    calibration = Calibration.load(str(CALIBRATIONS / "calibration_h200.json"))
    llm = ModuleShape("llm", "llm", hidden=4096, layers=8, heads=32, ffn=16384, seq_length=4096, vocab=32000)
    model = CostModel(Workload((), llm, global_batch=1), Cluster(2, 150), calibration)
    prediction = model.predict(Candidate("colocated", (ModuleLayout("llm", "llm", tp=2),), 1))
    assert prediction.step_s == pytest.approx(0.113, rel=0.05)


def test_measured_layer_time_replaces_the_curve_for_its_shape_and_layout_only():
    workload = tiny_workload()
    vision = workload.encoders[0]
    calibration = Calibration(layer_forward_us_per_token={LayerKey.of(vision, 1, 1): 2.0})
    model = CostModel(workload, Cluster(1, 10), calibration)
    forward, _ = model.microbatch_pass(vision, ModuleLayout("vision", "encoder"), 1, False)
    head = forward.compute - 2 * 2.0e-6 * 4  # 2 layers x 2 us x 4 tokens, plus the projector
    assert 0 < head < 1e-9 and forward.tp_comm == 0
    candidate = Candidate("colocated", (ModuleLayout("vision", "encoder"), ModuleLayout("llm", "llm")), 1)
    assert model.predict(candidate).curve_modules == ("llm",)
    # The same module name at another width, or at another TP size, is not the measured layer: the
    # curve prices it, and the reason says so.
    for wider, tp in ((replace(vision, hidden=8), 1), (vision, 2)):
        other = replace(workload, encoders=(wider,))
        layouts = (ModuleLayout("vision", "encoder", tp=tp), ModuleLayout("llm", "llm", dp=tp))
        measured, assumed = (CostModel(other, Cluster(tp, 10), c) for c in (calibration, Calibration()))
        assert measured.microbatch_pass(wider, layouts[0], 1, False) == \
            assumed.microbatch_pass(wider, layouts[0], 1, False)
        prediction = measured.predict(Candidate("colocated", layouts, 1))
        assert prediction.curve_modules == ("vision", "llm")
        assert "vision and llm layers from the efficiency curve" in explain(prediction, None, other, 10)


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("calibration_file", sorted(CALIBRATIONS.glob("calibration*.json")), ids=lambda p: p.stem)
def test_no_prediction_above_the_matmul_ceiling(name, calibration_file):
    """Every layout of every preset, with every shipped calibration: no GPU is predicted faster than
    the measured bf16 matmul ceiling (790 TFLOPS on an H200), which per-module layer times once broke
    (W1's 7B layer times applied to the paper preset's 70B: 949 TFLOPS/GPU)."""
    calibration = Calibration.load(str(calibration_file))
    preset = PRESETS[name]
    result = plan(preset.workload, Cluster(preset.gpus, 150.7), calibration)
    predictions = result.ranked + result.over_memory
    assert predictions
    assert max(p.tflops_per_gpu for p in predictions) <= calibration.matmul_tflops


def test_calibration_refuses_times_faster_than_the_ceiling_and_module_keyed_times():
    entry = {"role": "llm", "hidden": 4096, "ffn": 16384, "heads": 32, "sequence": 16384, "tp": 2}
    flops = layer_forward_flops_per_token(LayerKey(**entry).shape) / 2
    fastest_us = flops / 790e12 * 1e6
    Calibration.from_dict({"layer_forward_us_per_token": [{**entry, "us": 1.01 * fastest_us}]})
    with pytest.raises(ValueError, match="above matmul_tflops 790"):
        Calibration.from_dict({"layer_forward_us_per_token": [{**entry, "us": 0.99 * fastest_us}]})
    with pytest.raises(ValueError, match="a list of .* one per measured layer shape"):
        Calibration.from_dict({"layer_forward_us_per_token": {"llm": {"2": 0.6}}})
    with pytest.raises(ValueError, match="entry 1: us missing"):
        Calibration.from_dict({"layer_forward_us_per_token": [entry]})
    with pytest.raises(ValueError, match="entry 1: cp must be a positive integer"):
        Calibration.from_dict({"layer_forward_us_per_token": [{**entry, "role": "encoder", "cp": 0, "us": 1.0}]})


def test_layer_times_keyed_by_shape_round_trip():
    calibration = Calibration.load(str(CALIBRATIONS / "calibration_h200_measured.json"))
    assert calibration.layer_forward_us_per_token
    assert Calibration.from_dict(calibration.to_dict()) == calibration
    assert replace(calibration, max_efficiency=0.5).layer_forward_us_per_token == calibration.layer_forward_us_per_token


def test_calibration_and_workload_files_refuse_bad_input(tmp_path):
    with pytest.raises(ValueError, match="unknown key 'nvlink'"):
        Calibration.from_dict({"nvlink": 300})
    with pytest.raises(ValueError, match="max_efficiency"):
        Calibration.from_dict({"max_efficiency": 1.5})
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        Calibration.load(str(bad_json))
    with pytest.raises(ValueError, match="heads, ffn missing"):
        Workload.from_dict({"encoders": [], "llm": {"name": "llm", "hidden": 8, "layers": 1}, "global_batch": 1})
    with pytest.raises(ValueError, match="do not fit the llm's seq_length"):
        replace(W1, llm=replace(W1.llm, seq_length=8192))


def test_cli_prints_the_plan_and_writes_a_checked_layout(tmp_path):
    out = tmp_path / "best.yaml"
    workload_file = tmp_path / "w.json"
    vision, llm = W1.encoders[0], W1.llm
    workload_file.write_text(json.dumps({
        "encoders": [{k: getattr(vision, k) for k in ("name", "hidden", "layers", "heads", "ffn",
                                                      "tokens_per_item", "items_per_sample", "projector_ffn")}],
        "llm": {k: getattr(llm, k) for k in ("name", "hidden", "layers", "heads", "ffn", "seq_length", "vocab")},
        "global_batch": 16,
    }))
    result = run_tool("plan_layout", "--workload-file", workload_file, "--gpus", "4", "--write-yaml", out,
                      "--layouts", ROOT / "examples" / "layouts" / "demo_colocated.yaml")
    assert result.returncode == 0, result.stderr
    printed = result.stdout
    assert "best 5:" in printed and "best homogeneous:" in printed and "given layouts" in printed
    assert "PREDICTIONS" in printed
    assert load_layout(str(out), 4).world_size == 4
    result = run_tool("plan_layout", "--workload", "paper", "--top", "1")
    assert result.returncode == 0 and "published: +49.3% TFLOPS/GPU" in result.stdout
    # --llm-layers shrinks the LLM as bench_e2e's flag does: 8 layers of 4 x 4096^2 + 2 x 4096 x 16384
    # weights and a 32000 x 4096 embedding and output layer.
    result = run_tool("plan_layout", "--workload", "W4", "--llm-layers", "8", "--top", "1")
    assert result.returncode == 0 and "llm 1.87B parameters" in result.stdout


@pytest.mark.parametrize("argv, message", [
    (["--workload", "W1", "--gpus", "0"], "error: gpus must be a positive integer"),
    (["--workload", "W1", "--calibration", "/nonexistent.json"],
     "error: --calibration /nonexistent.json: neither a file nor a shipped calibration; name a file or one of "
     "h100_measured, h200"),
    (["--workload", "W1", "--calibration", "h300"], "error: --calibration h300: neither a file nor a shipped"),
    (["--workload", "W1", "--global-batch-size", "-1"], "error: global batch must be a positive integer"),
    (["--workload", "W1", "--gpus", "4", "--layouts", "examples/layouts/gpu2_colocated.yaml"],
     "error: examples/layouts/gpu2_colocated.yaml: module vision: tp*cp*dp*pp = 2"),
    (["--workload", "paper", "--as-trained"], "error: --as-trained: bench_e2e does not train paper; drop the flag"),
])
def test_cli_bad_input_is_one_error_line(argv, message):
    result = run_tool("plan_layout", *argv)
    assert result.returncode == 2
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1


# ---- mixture of experts ---------------------------------------------------------------------------

MOE = PRESETS["moe"].workload


def test_moe_flops_count_the_active_experts():
    moe = ModuleShape("llm", "llm", hidden=8, layers=1, heads=4, ffn=16, seq_length=8, vocab=1, experts=6, topk=2)
    # Q, K, V, O 8x8 each; the router 8 x 6; six experts of 2 x 8x16 held, two computed per token.
    assert layer_params(moe) == 4 * 64 + 8 * 6 + 6 * 2 * 8 * 16
    assert layer_params(moe, active=True) == 4 * 64 + 8 * 6 + 2 * 2 * 8 * 16
    assert layer_forward_flops_per_token(moe) == 2 * (4 * 64 + 8 * 6 + 2 * 2 * 8 * 16) + 4 * (8 / 2) * 8
    # Qwen3-30B-A3B's shape: about 30B parameters, about 3B active.
    llm = MOE.llm
    total = llm.layers * layer_params(llm) + 2 * llm.vocab * llm.hidden
    active = llm.layers * layer_params(llm, active=True) + 2 * llm.vocab * llm.hidden
    assert 28e9 < total < 32e9 and 2.5e9 < active < 3.5e9
    with pytest.raises(ValueError, match="topk 0 must be between 1 and experts 6"):
        replace(moe, topk=0)


def test_plan_ranks_moe_layouts_by_expert_parallelism():
    """On 8 GPUs the MoE LLM's experts fit only split (over EP, or TP / PP); the fastest splits
    them over EP. More EP costs more all-to-all traffic per token and holds fewer experts per GPU;
    the written layout file carries ep."""
    cluster = Cluster(8, 150)
    result = plan(MOE, cluster, Calibration())
    unsplit = [p for p in result.ranked + result.over_memory if p.candidate.llm.tp == p.candidate.llm.pp == 1]
    assert not any(p.fits for p in unsplit if p.candidate.llm.ep == 1)
    assert any(p.fits for p in unsplit if p.candidate.llm.ep > 1)
    assert result.best().candidate.llm.ep > 1
    model = CostModel(MOE, cluster, Calibration())
    vision = ModuleLayout("vision", "encoder", dp=8)
    by_ep = {ep: model.predict(Candidate("colocated", (vision, ModuleLayout("llm", "llm", dp=8, ep=ep)), 1))
             for ep in (2, 8)}
    assert 0 < by_ep[2].busy["llm"].ep_comm < by_ep[8].busy["llm"].ep_comm
    assert by_ep[8].memory_gb < by_ep[2].memory_gb
    dense = model.predict(Candidate("colocated", (vision, ModuleLayout("llm", "llm", dp=8)), 1))
    assert dense.busy["llm"].ep_comm == 0 and dense.memory_gb > by_ep[2].memory_gb
    best = result.best()
    written = parse_layout(yaml.safe_load(layout_yaml(best, MOE, cluster)), 8)
    assert written.llm.ep == best.candidate.llm.ep


def test_grouped_experts_add_their_weight_gradient_beyond_the_logits_once():
    """Grouped experts (the trainer's default on Hopper in bf16) hold fc1's weight gradient of every
    local expert and its fp32 copies at once, in the backward, after the loss has freed the logits:
    on top of SequentialMLP's peak what they hold beyond a microbatch's logits (Qwen3-30B-A3B's shape
    with a 1024-token vocabulary on EP 8: 16 experts x 1536 x 2048 x (2 + 4) bytes less 8192 x 1024 x 6;
    nothing with its own 151936, whose logits are larger), once (one layer at a time) whatever the
    depth, placement or microbatches in flight; none where SequentialMLP runs (one local expert,
    fp32 weights)."""
    vision = ModuleLayout("vision", "encoder", dp=8)
    candidates = [Candidate("colocated", (vision, ModuleLayout("llm", "llm", dp=8, ep=8)), 1),
                  Candidate("colocated", (ModuleLayout("vision", "encoder", dp=4),
                                          ModuleLayout("llm", "llm", dp=4, pp=2, ep=4)), 1),
                  Candidate("homogeneous", (ModuleLayout("vision", "encoder", tp=2, dp=2, pp=2),
                                            ModuleLayout("llm", "llm", tp=2, dp=2, pp=2, ep=2)), 1)]

    def extra_bytes(workload, candidate):
        memory = [CostModel(replace(workload, grouped_experts=grouped), Cluster(8, 150), Calibration())
                  .predict(candidate).memory_gb for grouped in (True, False)]
        return (memory[0] - memory[1]) * 1e9

    small = replace(MOE, llm=replace(MOE.llm, vocab=1024))
    for candidate in candidates:
        llm = candidate.llm
        local, fc1_rows = 128 // llm.ep, 2 * 768 // llm.tp
        logits = 8192 * 1024 / llm.tp * LOGIT_BYTES
        assert extra_bytes(small, candidate) == pytest.approx(local * fc1_rows * 2048 * 6 - logits, rel=1e-9)
        shallow = replace(small, llm=replace(small.llm, layers=24))
        assert extra_bytes(shallow, candidate) == pytest.approx(extra_bytes(small, candidate), rel=1e-9)
        assert extra_bytes(MOE, candidate) == 0
    assert grouped_experts_transient_bytes(MOE.llm, 1, 1, 2) / 1e9 == pytest.approx(2.42, abs=0.01)
    one_each = Candidate("colocated", (vision, ModuleLayout("llm", "llm", dp=8, ep=8)), 1)
    assert extra_bytes(replace(small, llm=replace(small.llm, experts=8)), one_each) == 0
    assert extra_bytes(replace(small, weight_bytes=4), candidates[0]) == 0


def test_packed_attention_keeps_the_copies_its_segments_make():
    """SDPA's packed path (models/varlen.py) keeps one more output copy where the segments take several
    calls (several lengths) and, where no permutation copies Q, K and V (the segments already lie by
    length), the QKV GEMM's output that V's view holds: the families' samples list their images from
    the smallest up, so Qwen3-VL's every layer keeps 1 + 2 q-wide tensors more, Qwen2.5-VL's 4 full
    layers of 32 as many and its windowed ones (windows of several sizes, out of order) the output
    copy; flash-attn-4 at the true head dim takes Q, K and V unpermuted (the held QKV output), padded
    it copies them (counted as the padded tensors)."""
    assert packed_sdpa_copies([[4, 4]]) == QKV_VIEW_COPIES
    assert packed_sdpa_copies([[4, 8]]) == 1 + QKV_VIEW_COPIES
    assert packed_sdpa_copies([[8, 4], [4, 8]]) == (1 + 1 + QKV_VIEW_COPIES) / 2
    # Windows of 4 patches cut a 6 x 5 item by rows: 4 x 4, 4 x 1, then 2 x 4, 2 x 1.
    assert window_lengths([(6, 5), (2, 2)], 4) == [16, 4, 8, 2, 4]
    qwen3, qwen2_5 = (FAMILY_BENCHES[name].workload(4).encoders[0] for name in ("qwen3_vl_8b", "qwen2_5_vl_7b"))
    assert qwen3.packed_sdpa_copies == 1 + QKV_VIEW_COPIES
    assert qwen2_5.packed_sdpa_copies == (4 * (1 + QKV_VIEW_COPIES) + 28) / 32
    for shape in (qwen3, qwen2_5):
        assert shape.packed_fa4_copies == QKV_VIEW_COPIES
        plain = activation_bytes_per_token_layer(shape, 1, False, 2)
        sdpa = activation_bytes_per_token_layer(shape, 1, False, 2, kernel="sdpa")
        fa4 = activation_bytes_per_token_layer(shape, 1, False, 2, run_head_dim=shape.head_size, kernel="fa4")
        padded = activation_bytes_per_token_layer(shape, 1, False, 2, run_head_dim=96, kernel="fa4")
        assert sdpa - plain == pytest.approx(2 * shape.packed_sdpa_copies * shape.q_dim)
        assert fa4 - plain == 2 * QKV_VIEW_COPIES * shape.q_dim
        assert padded == activation_bytes_per_token_layer(shape, 1, False, 2, run_head_dim=96)
    internvl = FAMILY_BENCHES["internvl3_8b"].workload(4).encoders[0]
    assert activation_bytes_per_token_layer(internvl, 1, False, 2, kernel="sdpa") == (
        activation_bytes_per_token_layer(internvl, 1, False, 2))


@pytest.mark.parametrize("name", ["qwen3_vl_8b", "qwen2_5_vl_7b"])
def test_packed_copies_read_the_trainers_plan(name):
    """The segments the planner reads from a family's sample are the trainer's: its VarlenPlan of
    the images (and of Qwen2.5-VL's windows, by transformers' window index) has several shapes, and
    no permutation, where packed_sdpa_copies counts them."""
    import torch
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_window_index

    from megatron_hetero.models.varlen import VarlenPlan

    bench = FAMILY_BENCHES[name]
    v = bench.config["vision_config"]
    grids = torch.tensor([[1, *bench.images[size]] for size in bench.sample_images()])
    cu_seqlens = [get_vision_cu_seqlens(grids)]
    if "window_size" in v:
        cu_seqlens.append(get_vision_window_index(grids, v["spatial_merge_size"], v["window_size"], v["patch_size"])[1])
    plans = [VarlenPlan.of(cu) for cu in cu_seqlens]
    full = len(v.get("fullatt_block_indexes", range(v["depth"])))
    kept = [(len(plan.groups) > 1) + QKV_VIEW_COPIES * (plan.order_q is None) for plan in plans]
    layers = [kept[0]] * full + kept[1:] * (v["depth"] - full)
    assert bench.workload(4).encoders[0].packed_sdpa_copies == pytest.approx(sum(layers) / len(layers))


def test_layer_scale_keeps_the_outputs_it_scales():
    """InternViT's layer scale multiplies the attention and MLP outputs by a trained per-channel scale,
    whose gradient needs them: 2 x hidden more per token and layer, split by TP under sequence
    parallelism only, as the norms' tensors."""
    internvl = FAMILY_BENCHES["internvl3_8b"].workload(4).encoders[0]
    unscaled = replace(internvl, layer_scale=False)
    assert internvl.layer_scale
    for tp, sp in ((1, False), (2, False), (2, True)):
        extra = (activation_bytes_per_token_layer(internvl, tp, sp, 2)
                 - activation_bytes_per_token_layer(unscaled, tp, sp, 2))
        assert extra == 2 * 2 * internvl.hidden / (tp if sp else 1)


def test_the_fused_cross_entropy_adds_one_fp32_copy_of_the_logits():
    """Megatron's --cross-entropy-loss-fusion (megatron-core's native fused loss) holds one more fp32
    copy of the LLM's logits while the loss runs: tokens x vocab / tp x 4 bytes on top of the unfused
    loss's peak, on the LLM's GPUs of every placement (CP splits the tokens; one microbatch in flight
    without PP), and nothing to an encoder's activations."""
    picked = {("colocated", "vision tp2 dp4 | llm dp8", 2), ("colocated", "vision dp8 | llm tp2 cp2 dp2 sp", 1),
              ("homogeneous", "vision tp4 dp2 | llm tp4 dp2 sp", 1),
              ("non_colocated", "vision dp4 @0-3 | llm tp2 dp2 sp @4-7", 1)}
    candidates = [c for group in enumerate_candidates(W1, Cluster(8, 150)) for c in group
                  if (c.placement, c.describe(), c.micro_batch) in picked]
    assert len(candidates) == len(picked)
    fused, unfused = (CostModel(replace(W1, fused_cross_entropy=on), Cluster(8, 150), Calibration())
                      for on in (True, False))
    assert FUSED_LOGIT_BYTES - LOGIT_BYTES == 4 and not W1.fused_cross_entropy
    for candidate in candidates:
        llm = candidate.llm
        extra = (fused.predict(candidate).memory_gb - unfused.predict(candidate).memory_gb) * 1e9
        tokens = candidate.micro_batch * W1.llm.seq_length / llm.cp
        assert extra == pytest.approx(tokens * W1.llm.vocab / llm.tp * 4, rel=1e-9)
    vision, layout = W1.encoders[0], candidates[0].encoders[0]
    assert fused.activation_bytes(vision, layout, 2, 0) == unfused.activation_bytes(vision, layout, 2, 0) > 0


def test_quacks_cross_entropy_holds_the_logits_and_their_gradient_where_it_runs():
    """quack's cross entropy in place of the fused loss keeps 4 bytes per logit (the bf16 logits and their
    gradient) where the vocabulary is whole on a rank; under TP megatron-core's fused loss runs, 10."""
    assert bytes_per_logit(True, True, 1) == QUACK_LOGIT_BYTES == 4
    assert bytes_per_logit(True, True, 2) == bytes_per_logit(True, False, 1) == FUSED_LOGIT_BYTES
    assert bytes_per_logit(False, False, 1) == LOGIT_BYTES
    with pytest.raises(ValueError, match="set fused_cross_entropy true as well"):
        replace(W1, quack_cross_entropy=True)
    fused = replace(W1, fused_cross_entropy=True)
    models = {quack: CostModel(replace(fused, quack_cross_entropy=quack), Cluster(8, 150), Calibration())
              for quack in (True, False)}
    llm = W1.llm
    for tp, per_logit in ((1, QUACK_LOGIT_BYTES), (2, FUSED_LOGIT_BYTES)):
        layout = ModuleLayout("llm", "llm", tp=tp, dp=8 // tp)
        tokens = 2 * llm.tokens_per_sample
        assert models[True].logit_bytes(llm, layout, 2) == tokens * llm.vocab / tp * per_logit
        assert models[False].logit_bytes(llm, layout, 2) == tokens * llm.vocab / tp * FUSED_LOGIT_BYTES


def test_grouped_experts_transient_is_what_their_backward_allocates(monkeypatch):
    """The count against the tensors a tiny GroupedExperts builds on the CPU in bf16 under
    gradient-accumulation fusion, its weights placed apart (as by the distributed optimizer): when
    fc1's weight gradients are added to main_grad, the grouped GEMM's [experts, 2 ffn, hidden]
    weight gradient and its fp32 copies are alive, as many bytes as the planner counts; the stacked
    weight copies are smaller."""
    import torch
    import torch.distributed as dist
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_hetero.models.experts import GROUPED, GroupedExperts
    from megatron_hetero.models.kernel_policy import EXPERTS_KERNEL_ENV
    from tests.test_experts import COUNTS, FFN, HIDDEN, _config, _experts, _run
    from tests.test_mlp_kernels import _accumulating, tp_layers

    class Transients(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.weight_grads, self.at_add, self.stacks = [], [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._foreach_add_.List:
                alive = sum(n for ref, n in self.weight_grads if not ref.expired())
                self.at_add.append(alive + sum(t.numel() * t.element_size() for t in args[1]))
            out = func(*args, **(kwargs or {}))
            nbytes = out.numel() * out.element_size() if isinstance(out, torch.Tensor) else 0
            if func is torch.ops.aten._grouped_mm.default and out.dim() == 3:
                self.weight_grads.append((StorageWeakRef(out.untyped_storage()), nbytes))
            if func is torch.ops.aten.stack.default:
                self.stacks.append(nbytes)
            return out

    _accumulating(monkeypatch)
    monkeypatch.setattr(tp_layers, "_grad_accum_fusion_available", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setenv(EXPERTS_KERNEL_ENV, GROUPED)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        experts = _experts(GroupedExperts, _config(torch.bfloat16, gradient_accumulation_fusion=True))
        for weight in experts.parameters():
            weight.data = weight.data.clone()  # apart: each in its own tensor
            weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)
            weight.grad_added_to_main_grad = False
        with Transients() as seen:
            _run(experts, torch.bfloat16)
    finally:
        dist.destroy_process_group()
    shape = ModuleShape("llm", "llm", hidden=HIDDEN, layers=1, heads=1, ffn=FFN, gated_mlp=True, seq_length=8,
                        experts=len(COUNTS), topk=2)
    assert len(seen.at_add) == 2 and max(seen.at_add) == grouped_experts_transient_bytes(shape, 1, 1, 2)
    assert len(seen.stacks) == 4 and max(seen.stacks) < max(seen.at_add)



def _batched_candidates(images: int):
    """W1 with `images` a sample at micro batch 1, vision DP 4 beside an LLM at TP 4: (the workload,
    its cost model, a candidate per microbatches a pass the planner offers)."""
    vision = replace(W1.encoders[0], items_per_sample=images)
    workload = replace(W1, encoders=(vision,), micro_batch=1, global_batch=16)
    layouts = (ModuleLayout("vision", "encoder", dp=4), ModuleLayout("llm", "llm", tp=4, sp=True))
    batchings = encoder_batchings(workload, layouts, 1, choose=True)
    return workload, CostModel(workload, Cluster(4, 150), Calibration()), [Candidate("colocated", b, 1)
                                                                         for b in batchings]


def test_planner_batches_the_encoder_over_microbatches():
    """One image a microbatch over an encoder's 4 DP ranks keeps one busy; a pass over k
    microbatches (layout `microbatches`) keeps k busy: k times fewer passes, each rank still
    holding one image's activations. The planner offers each k up to the one that fills every
    rank and takes the fastest."""
    workload, model, candidates = _batched_candidates(images=1)
    assert [c.encoders[0].microbatches for c in candidates] == [1, 2, 4]
    vision = [model.predict(c).busy["vision"] for c in candidates]
    for k, busy in zip((2, 4), vision[1:]):
        assert busy.compute == pytest.approx(vision[0].compute / k, rel=0.01)
        assert busy.boundary == vision[0].boundary  # rows still cross per microbatch
    assert len({model.predict(c).memory_gb for c in candidates}) == 1
    best = best_micro_batch(model, candidates)
    assert best.candidate.encoders[0].microbatches == 4
    assert "vision dp4 4 microbatches a pass" in best.candidate.describe()
    assert "microbatches: 4" in layout_yaml(best, workload, Cluster(4, 150))
    # a layout file's k is kept where it divides the step's 16 microbatches
    layouts = candidates[2].layouts
    assert encoder_batchings(workload, layouts, 1, choose=False) == [layouts]
    assert encoder_batchings(workload, (replace(layouts[0], microbatches=3), layouts[1]), 1, choose=False) == []


def test_planner_takes_the_microbatches_a_pass_that_fit():
    """Three images a microbatch over 4 DP ranks: a pass over 4 microbatches gives each rank 3
    (0.75 a microbatch, against 1), 3 times the busiest rank's activations; where those do not
    fit the planner keeps fewer microbatches a pass."""
    _, model, candidates = _batched_candidates(images=3)
    predictions = [model.predict(c) for c in candidates]
    samples = [model.encoder_samples(c, c.encoders[0]) for c in candidates]
    assert samples == [1 / 3, 2 / 3, 1]  # of 3-image samples, the busiest rank's a pass
    assert predictions[2].busy["vision"].compute < predictions[0].busy["vision"].compute
    assert best_micro_batch(model, candidates).candidate.encoders[0].microbatches == 4
    tight = (predictions[0].memory_gb + predictions[2].memory_gb) / 2 / Calibration().usable_memory_fraction
    tight_model = CostModel(model.workload, Cluster(4, tight), Calibration())
    assert best_micro_batch(tight_model, candidates).candidate.encoders[0].microbatches < 4


@pytest.mark.parametrize("name", ["qwen3_vl_4b", "qwen3_vl_8b", "qwen2_5_omni_7b", "internvl3_8b"])
def test_planner_counts_a_tied_output_layer_once(name):
    """The planner's LLM ties its output layer to its input embedding where the family's own config
    reader (the model that trains) does, and then counts one vocabulary matrix of weights, not two."""
    from transformers import AutoConfig

    from megatron_hetero.families import family_of_config
    from megatron_hetero.planner.counts import head_params

    bench = FAMILY_BENCHES[name]
    config = AutoConfig.for_model(bench.model_type, **bench.hf_config(4))
    sizes = family_of_config(config).sizes(config)
    llm = bench.workload(llm_layers=4).llm
    assert llm.tied_embeddings == sizes.llm_arch.tied_embeddings
    assert head_params(llm, llm.hidden) == (1 if sizes.llm_arch.tied_embeddings else 2) * llm.vocab * llm.hidden
    assert name != "qwen3_vl_4b" or llm.tied_embeddings  # the one tied preset among them
