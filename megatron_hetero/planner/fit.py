"""The calibration fitted to measured runs of tools/bench_e2e.py (tools/check_planner.py is its
command line).

Runs come in groups: one workload as the trainer built it, on one GPU count and global batch; each
run is one layout at one micro batch size, with the phase times and peak memory bench_e2e recorded
(or none: it ran out of memory). Each module a run does not pipeline is an observation: its time
per step on one of its GPUs in forward-pass equivalents (forward + backward over 3, or over 4 for
an encoder whose forward the colocated schedule reruns; a frozen module's forward). Fitted:
- the efficiency curve (max_efficiency, half_efficiency_width): an observation without CP implies
  an efficiency, its model FLOPs at matmul_tflops over its time less the model's TP communication;
  with e the mean of those per layer shape and layout and w its GEMM width (hidden / tp),
  1 / e = 1 / max_efficiency + half_efficiency_width / max_efficiency x 1 / w is a straight line,
  fitted by least squares over the shapes;
- layer_forward_us_per_token per layer shape and layout (CP included): an observation's time less
  its head (projector or output layer, at the curve), per layer and token of one GPU, averaged;
- activation_memory_factor: the largest over runs of (measured peak - the model's weights,
  gradients and optimizer states) / the model's activations, so that the planner errs toward "over
  memory".
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

from megatron_hetero.layout import HeteroLayout, ModuleLayout, load_layout
from megatron_hetero.planner.calibration import Calibration, LayerKey
from megatron_hetero.planner.candidates import candidate_from_layout
from megatron_hetero.planner.cost import CostModel, Prediction, encoder_forward_reruns, layer_key, split_cp
from megatron_hetero.planner.presets import BENCH_WORKLOADS, trainer_workload
from megatron_hetero.planner.shapes import H200_MEMORY_GB, Cluster, ModuleShape, Workload

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
class Group:
    """Runs of one workload, as the trainer built it, on one GPU count."""

    workload: Workload
    gpus: int
    runs: tuple[Run, ...]

    def __post_init__(self):
        object.__setattr__(self, "runs", tuple(self.runs))

    def model(self, calibration: Calibration) -> CostModel:
        return CostModel(self.workload, Cluster(self.gpus, H200_MEMORY_GB), calibration)


def measured_groups(records: list[dict], layouts: Path, vocab: int) -> dict[tuple, Group]:
    """bench_e2e's records of layouts in `layouts` (upstream rows have none) as groups keyed by
    (workload, LLM layers, GPUs, global batch), the workload as the trainer built it with this
    vocabulary."""
    runs = defaultdict(list)
    for r in records:
        file = layouts / f"{r['layout']}.yaml"
        if file.exists():
            w = BENCH_WORKLOADS[r["workload"]]  # runs recorded before batch sizes were: the workload's
            key = r["workload"], r["llm_layers"], r["gpus"], r.get("global_batch", w.global_batch)
            runs[key].append(Run(r["layout"], load_layout(str(file), r["gpus"]), r.get("micro_batch", w.micro_batch),
                                 r["tokens_per_s"], r["peak_gb_max"], r["phases"]))
    groups = {}
    for (name, layers, gpus, global_batch), found in runs.items():
        w = replace(BENCH_WORKLOADS[name], layers=layers, global_batch=global_batch)
        groups[name, layers, gpus, global_batch] = Group(trainer_workload(w, vocab, w.frozen), gpus, found)
    return groups


@dataclass(frozen=True)
class Observation:
    """A module a run does not pipeline, on one of its GPUs: the samples it ran per step and its
    measured time in forward-pass equivalents."""

    group: Group
    shape: ModuleShape
    layout: ModuleLayout
    samples: float
    measured_s: float

    @property
    def key(self) -> LayerKey:
        return layer_key(self.shape, self.layout)

    def _forward(self, calibration: Calibration):
        """The planner's forward of these samples from the efficiency curve (no measured times)."""
        model = self.group.model(replace(calibration, layer_forward_us_per_token={}))
        return model, model.microbatch_pass(self.shape, self.layout, self.samples, False)[0]

    def implied_efficiency(self, calibration: Calibration) -> float:
        """The model's FLOPs at matmul_tflops over the measured time less the model's communication."""
        _, unit = self._forward(replace(calibration, max_efficiency=1.0, half_efficiency_width=0.0))
        computing = self.measured_s - unit.tp_comm - unit.cp_comm
        if computing <= 0:
            raise ValueError(f"{self.key.describe()}: measured {self.measured_s:.4f} s is less than the modeled "
                             f"communication; the calibration's links are slower than this run's")
        return unit.compute / computing

    def curve_s(self, calibration: Calibration) -> float:
        """The time the planner predicts from the efficiency curve."""
        return self._forward(calibration)[1].total

    def layer_us(self, calibration: Calibration) -> float:
        """Microseconds per token of one layer on one GPU: the measured time less the head at the
        curve."""
        model, _ = self._forward(calibration)
        tokens = self.samples * self.shape.tokens_per_sample / split_cp(self.shape, self.layout)
        head_s = model.head_forward_s(self.shape, self.layout, self.samples)
        return 1e6 * (self.measured_s - head_s) / (self.shape.layers * tokens)


def observations(group: Group) -> list[Observation]:
    """Every measured run's modules that it does not pipeline, with the share of the global batch
    one of their GPUs runs."""
    shapes = {shape.name: shape for shape in group.workload.modules}
    found = []
    for run in group.runs:
        if run.tokens_per_s is None:
            continue
        for module in run.layout.modules:
            if module.pp > 1:
                continue
            shape = shapes[module.name]
            rerun = shape.role == "encoder" and encoder_forward_reruns(run.layout.placement, run.layout.llm)
            passes = 1 if shape.frozen else 4 if rerun else 3
            phases = sum(run.phases[f"{module.role}-{way}"] for way in ("forward", "backward"))
            found.append(Observation(group, shape, module, group.workload.global_batch / module.dp, phases / passes))
    return found


def fit_curve(seen: list[Observation], base: Calibration) -> Calibration:
    """The base calibration with the efficiency curve fitted to the observations without CP (the
    base's half width kept when they have one GEMM width; the base unchanged without any)."""
    inverse = defaultdict(list)
    for o in seen:
        if o.key.cp == 1:
            inverse[o.key].append(1 / o.implied_efficiency(base))
    points = [(key.tp / key.hidden, statistics.mean(values)) for key, values in inverse.items()]
    if not points:
        return base
    xs, ys = zip(*points)
    half = base.half_efficiency_width
    if len(set(xs)) > 1:
        slope, intercept = statistics.linear_regression(xs, ys)
        half = max(0.0, slope / intercept) if intercept > 0 else half
    # 1 / e = (1 + half / w) / max: the least-squares max for that half width.
    factors = [1 + half * x for x in xs]
    most = sum(f * f for f in factors) / sum(f * y for f, y in zip(factors, ys))
    return replace(base, max_efficiency=min(1.0, most), half_efficiency_width=half)


def predict_run(run: Run, group: Group, calibration: Calibration) -> Prediction:
    """The planner's prediction for the run's layout at the run's micro batch size."""
    cluster = Cluster(group.gpus, H200_MEMORY_GB)
    (candidate,) = candidate_from_layout(run.layout, replace(group.workload, micro_batch=run.micro_batch), cluster)
    return group.model(calibration).predict(candidate)


def fit(groups: list[Group], base: Calibration) -> Calibration:
    """The base calibration with the efficiency curve, the layer times of every observed shape and
    layout, and the activation memory factor fitted to the groups' runs."""
    seen = [o for group in groups for o in observations(group)]
    curve = fit_curve(seen, base)
    times = defaultdict(list)
    for o in seen:
        times[o.key].append(o.layer_us(curve))
    ordered = sorted(times, key=LayerKey.describe)
    fitted = replace(curve, layer_forward_us_per_token={key: statistics.mean(times[key]) for key in ordered})
    factors = []
    for group in groups:
        for run in group.runs:
            if run.peak_gb is not None:
                once, twice = (predict_run(run, group, replace(fitted, activation_memory_factor=f)).memory_gb
                               for f in (1.0, 2.0))  # memory is linear in the factor
                activations = twice - once
                factors.append((run.peak_gb * GIB - (once - activations)) / activations)
    return replace(fitted, activation_memory_factor=max(factors, default=base.activation_memory_factor),
                   source="max_efficiency, half_efficiency_width, layer_forward_us_per_token and "
                          "activation_memory_factor fitted by tools/check_planner.py to bench_e2e runs; the "
                          f"other keys: {base.source}")


def left_out_errors(seen: list[Observation], base: Calibration) -> dict[LayerKey, float]:
    """Per observed layer shape and layout, how far the curve fitted without it lands from its
    measurements: the mean over its observations of predicted / measured time - 1."""
    errors = {}
    for key in sorted({o.key for o in seen}, key=LayerKey.describe):
        curve = fit_curve([o for o in seen if o.key != key], base)
        errors[key] = statistics.mean(o.curve_s(curve) / o.measured_s - 1 for o in seen if o.key == key)
    return errors
