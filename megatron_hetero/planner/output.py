"""What the planner writes: the reason a prediction ranks where it does, and the layout file of a
prediction."""

from __future__ import annotations

from megatron_hetero.planner.cost import Prediction
from megatron_hetero.planner.shapes import Cluster, Workload
from megatron_hetero.spec.layout import AXES, ModuleLayout


def _components(prediction: Prediction, workload: Workload) -> dict[str, float]:
    """Seconds per step of the critical GPU by what it does (encoders together)."""
    result = {"encoder compute": 0.0, "encoder TP comm": 0.0, "LLM compute": 0.0, "LLM TP comm": 0.0,
              "CP comm": 0.0, "EP all-to-all": 0.0, "pipeline sends": 0.0, "boundary": 0.0, "DP sync": 0.0,
              "pipeline wait": prediction.idle_s}
    for name, seconds in prediction.busy.items():
        who = "LLM" if name == workload.llm.name else "encoder"
        result[f"{who} compute"] += seconds.compute
        result[f"{who} TP comm"] += seconds.tp_comm
        result["CP comm"] += seconds.cp_comm
        result["EP all-to-all"] += seconds.ep_comm
        result["pipeline sends"] += seconds.p2p
        result["boundary"] += seconds.boundary
        result["DP sync"] += seconds.dp_sync
    return result


def _axes(layout: ModuleLayout) -> str:
    sizes = [f"{axis.upper()}{getattr(layout, axis)}" for axis in (*AXES, "ep") if getattr(layout, axis) > 1]
    return "/".join(sizes or ["TP1"]) + ("+SP" if layout.sp else "")


def _gpus(n: int) -> str:
    return f"{n} GPU" + ("" if n == 1 else "s")


def _versus(prediction: Prediction, reference: Prediction, workload: Workload) -> str:
    """The step time against the reference and the components that moved most: the two largest
    savings and the largest extra cost (each over 0.5% of the reference step)."""
    ours, theirs = _components(prediction, workload), _components(reference, workload)
    deltas = sorted((ours[k] - theirs[k], k) for k in ours)
    threshold = 0.005 * reference.step_s
    moved = [f"{k} {delta:+.2f} s" for delta, k in deltas[:2] if delta < -threshold]
    moved += [f"{k} {delta:+.2f} s" for delta, k in deltas[-1:] if delta > threshold]
    net = prediction.step_s - reference.step_s
    return f"vs best homogeneous {net:+.2f} s/step" + (f" ({', '.join(moved)})" if moved else "")


def explain(prediction: Prediction, reference: Prediction | None, workload: Workload, capacity_gb: float) -> str:
    """Why this layout ranks where it does: its encoders' and LLM's layouts, memory headroom, and
    what moved against the best homogeneous layout."""
    candidate = prediction.candidate
    llm = candidate.llm
    phrases = []
    if candidate.placement == "homogeneous":
        tp_phrase = f"TP{llm.tp}" + (f" replicated over CP{llm.cp}" if llm.cp > 1 else "")
        where = f" on the first of {llm.pp} LLM stages" if llm.pp > 1 else ""
        phrases.append(f"Megatron today: encoders at the LLM's {tp_phrase}{where}")
        if llm.pp > 1:
            phrases.append(f"first stage {prediction.stage_s['first stage']:.2f} s vs "
                           f"{prediction.stage_s[llm.name]:.2f} s per microbatch")
    for layout in candidate.encoders if candidate.placement != "homogeneous" else ():
        shape = next(e for e in workload.encoders if e.name == layout.name)
        notes = []
        if layout.tp < llm.tp:
            notes.append(f"not the LLM's TP{llm.tp}: no TP{llm.tp} all-reduces on its "
                         f"{shape.tokens_per_sample:,} tokens per sample")
        cap = candidate.micro_batch * llm.dp
        if layout.dp == cap and layout.size > layout.dp:
            notes.append(f"DP at the trainer's cap, micro batch x LLM DP = {cap}")
        text = f"{layout.name} at {_axes(layout)}" + (f" ({'; '.join(notes)})" if notes else "")
        if candidate.placement == "colocated":
            text += " on all GPUs"
        else:
            text += (f" on {_gpus(layout.size)}, {prediction.stage_s[layout.name]:.2f} s vs LLM "
                     f"{prediction.stage_s[llm.name]:.2f} s per microbatch")
        phrases.append(text)
    llm_text = f"LLM {_axes(llm)}"
    if llm.cp > 1:
        llm_text += f" (CP{llm.cp} splits the {workload.llm.seq_length // 1024}K sequence)"
    fits = "fits" if prediction.fits else "needs"
    phrases.append(f"{llm_text} {fits} {prediction.memory_gb:.0f} of {capacity_gb:.0f} GB")
    if prediction.idle_s > 0.005 * prediction.step_s:
        phrases.append(f"LLM GPUs wait {100 * prediction.idle_s / prediction.step_s:.0f}% of the step")
    if prediction.curve_modules:
        phrases.append(f"{' and '.join(prediction.curve_modules)} layers from the efficiency curve "
                       f"(no measured time for that shape and layout)")
    if reference is not None and reference is not prediction:
        phrases.append(_versus(prediction, reference, workload))
    return "; ".join(phrases)


def layout_yaml(prediction: Prediction, workload: Workload, cluster: Cluster) -> str:
    """A layout file for `python -m megatron_hetero.layout check FILE --world-size N` and the
    trainer's --hetero-layout, with the prediction and Megatron's flags to train it with (batch sizes,
    distributed optimizer, recomputation) in its header."""
    candidate = prediction.candidate
    layout = candidate.hetero_layout(cluster.gpus)
    extra = " ".join((["--use-distributed-optimizer"] if workload.distributed_optimizer else [])
                     + ([candidate.recompute.flags()] if candidate.recompute else []))
    lines = [
        f"# Written by megatron-hetero plan for {cluster.gpus} GPUs, {candidate.placement}: {candidate.describe()}",
        f"# Predicted (from the calibration, not measured): {prediction.step_s:.2f} s/step, "
        f"{prediction.tokens_per_s:,.0f} tokens/s, {prediction.tflops_per_gpu:.0f} TFLOPS/GPU, "
        f"{prediction.memory_gb:.0f} GB/GPU",
        f"# Train with --global-batch-size {workload.global_batch} --micro-batch-size {candidate.micro_batch}"
        + (f" {extra}" if extra else ""),
        *([f"# ({candidate.recompute.describe()} of each stage, every trainable module: the fewest that fit)",
           f'# benchmarks/bench_e2e.py --flags="{extra}"'] if candidate.recompute else []),
        f"placement: {layout.placement}",
        "modules:",
    ]
    for module in layout.modules:
        lines += [f"  {module.name}:", f"    role: {module.role}"]
        lines += [f"    {axis}: {getattr(module, axis)}" for axis in AXES]
        if module.ep > 1:
            lines.append(f"    ep: {module.ep}")
        if module.sp:
            lines.append("    sp: true")
        if module.freeze:
            lines.append("    freeze: true")
        lines += [f"    {flag}: true" for flag in ("cp_replicated", "on_first_stage") if getattr(module, flag)]
        if module.microbatches > 1:
            lines.append(f"    microbatches: {module.microbatches}")
        if layout.placement == "non_colocated":
            lines.append(f"    ranks: {module.ranks.start}-{module.ranks.stop - 1}")
    lines.append("edges:")
    lines += [f"  - {edge}" for edge in layout.edges]
    return "\n".join(lines) + "\n"
