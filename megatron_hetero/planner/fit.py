"""The calibration fitted to measured runs of tools/bench_e2e.py (tools/check_planner.py is the
command line; its docstring says what is fitted and how).

A group of runs shares a workload, an LLM depth, a GPU count and a global batch; each run is one
layout at one micro batch size, with the phase times and peak memory bench_e2e recorded (or none:
it ran out of memory)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, replace

from megatron_hetero.layout import HeteroLayout
from megatron_hetero.planner.calibration import Calibration
from megatron_hetero.planner.candidates import candidate_from_layout
from megatron_hetero.planner.cost import CostModel, Prediction
from megatron_hetero.planner.counts import head_forward_flops_per_sample, layer_forward_flops_per_token
from megatron_hetero.planner.shapes import H200_MEMORY_GB, Cluster, Workload

GIB = 2**30 / 1e9  # bench_e2e records peak memory in GiB


@dataclass(frozen=True, eq=False)  # each run is itself (hashed by identity)
class Run:
    """One measured (or out-of-memory) run of a group: its layout and what bench_e2e recorded."""

    name: str  # the layout file's name
    layout: HeteroLayout
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


def observations(run: Run, workload: Workload) -> list[Observation]:
    """The run's non-pipelined modules, with the share of the global batch one of their GPUs runs."""
    found = []
    for module in run.layout.modules:
        if module.pp > 1:
            continue
        shape = workload.llm if module.role == "llm" else workload.encoders[0]
        cp = module.cp if module.role == "llm" else 1
        samples = workload.global_batch / module.dp
        forward, backward = (run.phases[f"{module.role}-{way}"] for way in ("forward", "backward"))
        passes = forward if shape.frozen else (forward + backward) / 3
        found.append(Observation(module.role, module.tp, cp, samples, samples * shape.tokens_per_sample / cp, passes))
    return found


def fit(runs: list[Run], workload: Workload, gpus: int, base: Calibration) -> Calibration:
    """The base calibration with max_efficiency and layer_forward_us_per_token fitted to the runs."""
    shapes = {"encoder": workload.encoders[0], "llm": workload.llm}
    seen = [o for run in runs if run.tokens_per_s is not None for o in observations(run, workload)]
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
            once, twice = (predict_run(run, workload, gpus, replace(fitted, activation_memory_factor=f)).memory_gb
                           for f in (1.0, 2.0))  # memory is linear in the factor
            activations = twice - once
            factors.append((run.peak_gb * GIB - (once - activations)) / activations)
    return replace(fitted, activation_memory_factor=max(factors, default=base.activation_memory_factor),
                   source="max_efficiency, layer_forward_us_per_token and activation_memory_factor fitted by "
                          f"tools/check_planner.py to bench_e2e runs; the other keys: {base.source}")


def predict_run(run: Run, workload: Workload, gpus: int, calibration: Calibration) -> Prediction:
    """The planner's prediction for the run's layout at the run's micro batch size."""
    cluster = Cluster(gpus, H200_MEMORY_GB)
    (candidate,) = candidate_from_layout(run.layout, replace(workload, micro_batch=run.micro_batch), cluster)
    return CostModel(workload, cluster, calibration).predict(candidate)
