"""The calibration fitted to measured runs of benchmarks/bench_e2e.py (tools/check_planner.py is its
command line).

Runs come in groups: one workload as the trainer built it, on one GPU count and global batch; each
run is one layout at one micro batch size with the Megatron flags it ran with (the distributed
optimizer, recomputation: bench_e2e records them in the run's name, `layout [flags]`), with the
phase times and peak memory bench_e2e recorded (or none: it ran out of memory); a layout measured
again with the same flags replaces its older record. Each module a run does not pipeline is an
observation: its time per step on one of its GPUs in forward-pass equivalents (forward + backward
over 3, plus 1 for an encoder whose forward the colocated schedule reruns, plus the share of its
layers it recomputes; a frozen module's forward). Fitted:
- the efficiency curve (max_efficiency, half_efficiency_width): an observation without CP implies
  an efficiency, its model FLOPs at matmul_tflops over its time less the model's TP communication;
  with e the mean of those per layer shape and layout and w its GEMM width (hidden / tp),
  1 / e = 1 / max_efficiency + half_efficiency_width / max_efficiency x 1 / w is a straight line,
  fitted by least squares over the shapes;
- layer_forward_us_per_token per layer shape and layout (CP included): an observation's time less
  its head (projector or output layer, at the curve), per layer and token of one GPU, averaged;
- the activation memory factors, by least squares over the runs: measured peak = the model's
  weights, gradients, optimizer states and logits + the sum of each factor x the activations of the
  modules it scales (a straight line through the origin in the activations): one per module role
  and attention kernel where the record names its kernels (activation_memory_factors), the single
  activation_memory_factor for modules of records that do not. (The largest ratio over the runs was
  used before; it let the one run with the least activations, a full-recomputation run whose peak is
  mostly weights, set the factor for all and over-predicted the others by up to 20%.)
"""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from megatron_hetero.models.attention_input import SUMMARY as TRITON_ATTENTION_INPUT
from megatron_hetero.planner.calibration import Calibration, LayerKey
from megatron_hetero.planner.candidates import Recompute, candidate_from_layout
from megatron_hetero.planner.cost import CostModel, Prediction, encoder_forward_reruns, layer_key, split_cp
from megatron_hetero.planner.presets import (
    BENCH_WORKLOADS,
    FAMILY_BENCH_WORKLOADS,
    BenchWorkload,
    resized_workload,
    trainer_vocab_size,
    trainer_workload,
)
from megatron_hetero.planner.shapes import H100_MEMORY_GB, H200_MEMORY_GB, Cluster, ModuleShape, Workload
from megatron_hetero.spec.layout import SCHEDULE_FLAG, ColocatedSchedule, HeteroLayout, ModuleLayout, load_layout

GIB = 2**30 / 1e9  # bench_e2e records peak memory in GiB
# bench_e2e's run name: the layout file's stem, " (schedule)" unless the default, " [flags]" if any.
RUN_NAME = re.compile(r"(?P<stem>[^ ]+)(?: \((?P<schedule>[^)]+)\))?(?: \[(?P<flags>.*)\])?")


def megatron_recompute(flags: tuple[str, ...], stage_layers: int) -> Recompute | None:
    """The recomputation Megatron's flags ask for, for an LLM stage of `stage_layers` layers:
    --recompute-method uniform recomputes every layer, block the first --recompute-num-layers of
    each stage (ValueError for selective recomputation, which the planner does not model)."""
    values = dict(zip(flags, flags[1:]))
    granularity = values.get("--recompute-granularity")
    if granularity is None:
        return None
    if granularity != "full":
        raise ValueError(f"--recompute-granularity {granularity}: the planner models full recomputation only")
    if values.get("--recompute-method") == "block":
        return Recompute(min(int(values.get("--recompute-num-layers", stage_layers)), stage_layers), stage_layers)
    return Recompute(stage_layers, stage_layers)


@dataclass(frozen=True, eq=False)  # each run is itself (hashed by identity)
class Run:
    """One measured (or out-of-memory) run of a group: its layout and what bench_e2e recorded."""

    name: str  # bench_e2e's: the layout file's name, then the flags in brackets
    layout: HeteroLayout
    micro_batch: int
    tokens_per_s: float | None  # None: ran out of memory
    peak_gb: float | None
    phases: dict
    flags: tuple[str, ...] = ()  # Megatron's flags the run added
    weight_bytes: int = 2  # bf16 weights (Megatron's --bf16); 4: fp32 weights (records without `precision`)
    fused_mlp: bool = False  # the MLPs ran GELU in quack's GEMMs (the record's `mlp`: models/mlp.py)
    fused_gated_bias_mlp: bool = False  # an encoder's MLP ran on quack (a gated one: with its fc1 biases)
    grouped_experts: bool = False  # the MoE experts ran grouped GEMMs (the record's `experts`: models/experts.py)
    attention: tuple = ()  # (module, kernel, head dim it ran at): the record's `attention` (record_attention)
    quack_loss: bool = False  # the loss ran quack's cross entropy (the record's `loss`: models/loss_kernels.py)

    @property
    def label(self) -> str:
        """The layout file's stem and, briefly, the flags: distopt, the recomputed layers."""
        values = dict(zip(self.flags, self.flags[1:]))
        notes = ["distopt"] if "--use-distributed-optimizer" in self.flags else []
        if "--recompute-granularity" in values:
            block = values.get("--recompute-method") == "block"
            notes.append(f"recompute {values.get('--recompute-num-layers')} layers" if block else "full recompute")
        return RUN_NAME.fullmatch(self.name)["stem"] + (f" [{', '.join(notes)}]" if notes else "")

    @property
    def fused_cross_entropy(self) -> bool:
        """The loss ran on megatron-core's native fused cross entropy (Megatron's flag)."""
        return "--cross-entropy-loss-fusion" in self.flags

    def recompute(self, workload: Workload) -> Recompute | None:
        return megatron_recompute(self.flags, workload.llm.layers // self.layout.llm.pp)

    def workload(self, workload: Workload) -> Workload:
        """The group's workload at this run's micro batch size, optimizer and loss."""
        return replace(workload, micro_batch=self.micro_batch, weight_bytes=self.weight_bytes,
                       distributed_optimizer="--use-distributed-optimizer" in self.flags, fused_mlp=self.fused_mlp,
                       fused_gated_bias_mlp=self.fused_gated_bias_mlp, grouped_experts=self.grouped_experts,
                       fused_cross_entropy=self.fused_cross_entropy,
                       quack_cross_entropy=self.fused_cross_entropy and self.quack_loss, attention=self.attention)


@dataclass(frozen=True)
class Group:
    """Runs of one workload, as the trainer built it, on one GPU count and memory per GPU (GB: what
    the planner's predictions are judged to fit)."""

    workload: Workload
    gpus: int
    runs: tuple[Run, ...]
    memory_gb: float = H200_MEMORY_GB

    def __post_init__(self):
        object.__setattr__(self, "runs", tuple(self.runs))

    def model(self, calibration: Calibration) -> CostModel:
        return CostModel(self.workload, Cluster(self.gpus, self.memory_gb), calibration)


def record_run(record: dict, layouts: Path) -> Run | None:
    """A bench_e2e record as a run, or None: a layout not in `layouts` (upstream rows) or run under
    a colocated schedule other than the default the planner models."""
    name = RUN_NAME.fullmatch(record["layout"])
    file = layouts / f"{name['stem']}.yaml"
    flags = tuple((name["flags"] or "").split())
    # The schedule comes in the name or, from benchmarks/gpu2_layouts_run.sh, as the training script's flag.
    schedule = dict(zip(flags, flags[1:])).get(SCHEDULE_FLAG)  # read as megatron_recompute reads its flags
    scheduled = name["schedule"] or schedule not in (None, ColocatedSchedule.RECOMPUTE)
    if scheduled or not file.exists():
        return None
    w = RECORDED_WORKLOADS[record["workload"]]  # runs recorded before batch sizes were: the workload's
    mlp = record.get("mlp", {})
    return Run(record["layout"], load_layout(str(file), record["gpus"]), record.get("micro_batch", w.micro_batch),
               record["tokens_per_s"], record["peak_gb_max"], record["phases"], flags,
               2 if record.get("precision", "").startswith("bf16 weights") else 4,
               fused_mlp=any(kernel.startswith("quack") for kernel in mlp.values()),
               fused_gated_bias_mlp=any(kernel.startswith("quack") for name, kernel in mlp.items() if name != "llm"),
               grouped_experts=any(kernel.startswith("grouped") for kernel in record.get("experts", {}).values()),
               attention=record_attention(record),
               quack_loss=any(kernel.startswith("quack") for kernel in record.get("loss", {}).values()))


# bench_e2e's attention summary of a module (models/attention_kernels.py KernelChoice.summary): the
# kernel, then the head dim, and the one it was zero-padded to.
ATTENTION_SUMMARY = re.compile(r"(?P<kernel>fa4|sdpa) \(head dim (?P<dim>\d+)(?: zero-padded to (?P<padded>\d+))?")


def record_gpu(record: dict) -> str:
    """The shipped calibration's GPU model for a record: h100 or h200."""
    return "h100" if "H100" in record.get("device", "") else "h200"


def record_attention(record: dict) -> tuple:
    """(module, kernel, head dim it ran at) of each module whose kernel the record names (records from
    before bench_e2e named them: none)."""
    found, attention = [], record.get("attention")
    for module, summary in (attention if isinstance(attention, dict) else {}).items():
        match = ATTENTION_SUMMARY.match(summary) if isinstance(summary, str) else None
        if match:
            found.append((module, match["kernel"], int(match["padded"] or match["dim"])))
    return tuple(found)


def record_memory_gb(record: dict) -> float:
    """The memory per GPU a bench_e2e run had, in GB: its allocator's cap (`memory_cap_gib`) where it
    ran under one, else its GPU's (`device_memory_gib`; records from before that field by the GPU's
    name, those without a device the first calls', on H200s)."""
    for key in ("memory_cap_gib", "device_memory_gib"):
        if record.get(key):
            return round(record[key] * GIB, 1)
    return H100_MEMORY_GB if "H100" in record.get("device", "") else H200_MEMORY_GB


RECORDED_WORKLOADS = {**BENCH_WORKLOADS, **FAMILY_BENCH_WORKLOADS}


class GroupKey(NamedTuple):
    """What a group's runs share: the workload as trained, the GPUs and their memory (GB)."""

    workload: str
    layers: int
    gpus: int
    global_batch: int
    memory_gb: float
    seq_length: int
    items_per_sample: int
    image_size: int

    def describe(self) -> str:
        w = RECORDED_WORKLOADS[self.workload]
        sizes = [f"{self.seq_length} tokens"] if self.seq_length != w.seq_length else []
        sizes += [f"{self.items_per_sample} images per sample"] if self.items_per_sample != w.images_per_sample else []
        sizes += [f"{self.image_size}-px images"] if self.image_size != w.image_size else []
        return (f"{self.workload}, LLM {self.layers} layers, {self.gpus} GPUs of {self.memory_gb:g} GB, global batch "
                f"{self.global_batch}" + "".join(f", {s}" for s in sizes))


def record_workload(record: dict) -> BenchWorkload:
    """The workload a bench_e2e record trained: its preset at the record's LLM depth, global batch,
    sequence length, images per sample and image size (records without them: the preset's). A
    family's record counts its preset's items (InternVL: tiles, not images), so the preset's own
    count is kept as the preset's images."""
    w = RECORDED_WORKLOADS[record["workload"]]
    items = record.get("items_per_sample", 0)
    w = resized_workload(w, record.get("seq_length", 0), 0 if items == w.images_per_sample else items,
                         record.get("image_size", 0) if not w.family else 0)
    return replace(w, layers=record["llm_layers"], global_batch=record.get("global_batch", w.global_batch))


def measured_groups(records: list[dict], layouts: Path, vocab: int) -> dict[tuple, Group]:
    """bench_e2e's records of layouts in `layouts` as groups keyed by the workload as trained
    (record_workload), GPUs and memory per GPU in GB (GroupKey), the workload as the trainer built it with this
    vocabulary (a VLM family: its own); a later record of a run name replaces an earlier one."""
    runs = defaultdict(dict)
    for r in records:
        run = record_run(r, layouts)
        if run is not None:
            w = record_workload(r)
            key = GroupKey(w.name, w.layers, r["gpus"], w.global_batch, record_memory_gb(r), w.seq_length,
                           w.images_per_sample, w.image_size)
            runs[key, w][run.name] = run
    groups = {}
    for (key, w), found in runs.items():
        own_vocab = trainer_vocab_size(w) if w.family else vocab
        groups[key] = Group(trainer_workload(w, own_vocab, w.frozen), key.gpus, tuple(found.values()), key.memory_gb)
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
        return model, model.microbatch_pass(self.shape, self.layout, self.samples, 0)[0]

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
            recompute = run.recompute(group.workload)
            recomputed = recompute.of_stage(shape.layers) if recompute else 0
            passes = 1 if shape.frozen else 3 + rerun + recomputed / shape.layers
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
    cluster = Cluster(group.gpus, group.memory_gb)
    workload = run.workload(group.workload)
    (candidate,) = candidate_from_layout(run.layout, workload, cluster)
    return CostModel(workload, cluster, calibration).predict(replace(candidate, recompute=run.recompute(workload)))


def fit(groups: list[Group], base: Calibration) -> Calibration:
    """The base calibration with the efficiency curve, the layer times of every observed shape and
    layout, the activation memory factor and the usable memory share fitted to the groups' runs."""
    seen = [o for group in groups for o in observations(group)]
    curve = fit_curve(seen, base)
    times = defaultdict(list)
    for o in seen:
        times[o.key].append(o.layer_us(curve))
    ordered = sorted(times, key=LayerKey.describe)
    fitted = replace(curve, layer_forward_us_per_token={key: statistics.mean(times[key]) for key in ordered})
    fitted = memory_factors(groups, fitted)
    return replace(fitted, usable_memory_fraction=usable_fraction(groups, fitted),
                   source="max_efficiency, half_efficiency_width, layer_forward_us_per_token, "
                          "activation_memory_factor and usable_memory_fraction fitted by tools/check_planner.py "
                          f"to bench_e2e runs; the other keys: {base.source.rsplit('the other keys: ', 1)[-1]}")


def usable_fraction(groups: list[Group], calibration: Calibration) -> float:
    """The share of a GPU's memory a layout may fill: the calibration's own where it separates the
    runs that ran from those out of memory (or where nothing can: a run that ran predicted above one
    that did not), else midway between the largest predicted share of a run that ran and the
    smallest of one out of memory. (W6 on the H100s: TP2+SP recomputing 10 of 12 layers, predicted
    at 87% of the card, ran out; CP2 at 85% ran; the default 90% had both fit.)"""
    ran, out = [], []
    for group in groups:
        for run in group.runs:
            share = predict_run(run, group, calibration).memory_gb / group.memory_gb
            (ran if run.tokens_per_s is not None else out).append(share)
    low, high, current = max(ran, default=0.0), min(out, default=1.0), calibration.usable_memory_fraction
    if low >= high or low <= current < high:
        return current
    return round((low + high) / 2, 4)


# The activation memory factors fitted: the calibration's single one (modules whose attention kernel
# is not known) and one per module role and attention kernel (Calibration.activation_memory_factors).
FALLBACK = ""


def with_factors(calibration: Calibration, factors: dict) -> Calibration:
    """The calibration with these factors (FALLBACK: activation_memory_factor; others by key)."""
    keyed = {key: value for key, value in factors.items() if key != FALLBACK}
    return replace(calibration, activation_memory_factor=factors.get(FALLBACK, calibration.activation_memory_factor),
                   activation_memory_factors={**calibration.activation_memory_factors, **keyed})


def memory_split(run: Run, group: Group, calibration: Calibration, factors: dict) -> tuple[float, dict]:
    """(the predicted peak in GB less every factor's share, {factor key: activations at factor 1 in
    GB}) near `factors`, from a prediction with each factor 0.1 higher (memory is linear in the factors
    as long as the same module's GPUs hold the peak)."""
    base = predict_run(run, group, with_factors(calibration, factors)).memory_gb
    slopes = {key: (predict_run(run, group, with_factors(calibration, {**factors, key: value + 0.1})).memory_gb
                    - base) / 0.1 for key, value in factors.items()}
    return base - sum(factors[key] * slope for key, slope in slopes.items()), slopes


def factor_keys(run: Run, group: Group, by_kernel: bool) -> set[str]:
    """The factor keys a run's trainable modules take: their role and attention kernel (by_kernel)
    where known, else FALLBACK."""
    workload = run.workload(group.workload)
    keys = set()
    for shape in workload.modules:
        kernel = workload.attention_of(shape.name)[0] if by_kernel else ""
        if not shape.frozen:
            keys.add(f"{shape.role} {kernel}" if kernel else FALLBACK)
    return keys


def memory_factors(groups: list[Group], calibration: Calibration, by_kernel: bool = False, margin: float = 0.0,
                   passes: int = 3) -> Calibration:
    """The calibration with the activation memory factors fitted by least squares over the runs with a
    measured peak: measured peak x (1 + margin) = the rest of the prediction + the sum over the factor
    keys of factor x activations (a factor no run takes keeps the calibration's value), each pass
    splitting the runs' memory near the last pass's factors. Without `by_kernel` one factor for every
    module (what the few runs of a group can tell apart): the calibration's activation_memory_factor,
    its factors by role and kernel dropped."""
    if not by_kernel:
        calibration = replace(calibration, activation_memory_factors={})
    measured = [(run, group) for group in groups for run in group.runs if run.peak_gb is not None]
    keys = sorted(set().union(*(factor_keys(run, group, by_kernel) for run, group in measured)) if measured else set())
    factors = {key: calibration.activation_factor(*key.split(" ")) if key else calibration.activation_memory_factor
               for key in keys}
    for _ in range(passes if measured else 0):
        points = [(memory_split(run, group, calibration, factors), run.peak_gb * GIB) for run, group in measured]
        rows = [[slopes[key] for key in keys] for (_, slopes), _ in points]
        targets = [peak * (1 + margin) - rest for (rest, _), peak in points]
        if np.linalg.matrix_rank(np.array(rows)) < len(keys):
            raise ValueError(f"activation memory factors {keys}: some move together in every run; measure runs "
                             "that tell them apart")
        factors = dict(zip(keys, np.linalg.lstsq(np.array(rows), np.array(targets), rcond=None)[0].tolist()))
    return with_factors(calibration, factors)


# The band a predicted peak must land in (tests/test_planner_memory.py): at most this many GB under the
# measured peak (under: a layout predicted to fit may not) and at most this share above it.
MEMORY_UNDER_GB = 1.0
MEMORY_OVER_SHARE = 0.03
# The factors are fitted a little above the band's middle near 100 GB (1 GB under to 3 GB over: peak
# x 1.01), at peak x 1.0125: at x 1.01 the fit leaves two records 0.15 GB under the band.
MEMORY_MARGIN = 0.0125


def band_records(paths: list[Path], layouts: Path) -> list[tuple[Path, dict]]:
    """The one-GPU bench_e2e records the memory model is held to (MEMORY_UNDER_GB, MEMORY_OVER_SHARE),
    with the files they came from: bf16 weights, kernels named (the records of the current trainer),
    a layout the planner models; not an A/B pair's baseline (`*_A.jsonl`: the older checkout), nor a
    Qwen2.5-VL record whose ViT MLP ran megatron-core's unfused gated path (before its padded MLP);
    of one configuration (workload, depth, batch sizes, layout and flags, GPU model, kernels, loss, the
    packed ViT's attention input where its record names it on Triton) the latest record (its date, then
    the files' sorted paths: the answer does not depend on the order given)."""
    latest = {}
    for path in sorted(paths):
        if path.name.endswith("_A.jsonl"):
            continue
        for line in path.read_text().splitlines():
            record = json.loads(line) if line.strip() else {}
            if (record.get("gpus") != 1 or "peak_gb_max" not in record or not record_attention(record)
                    or not record.get("precision", "").startswith("bf16 weights")):
                continue
            vision_mlp = str(record.get("mlp", {}).get("vision", ""))
            if record["workload"] == "qwen2_5_vl_7b" and "zero-padded" not in vision_mlp:
                continue
            run = record_run(record, layouts)
            if run is None:
                continue
            key = (record["workload"], record["llm_layers"], record.get("global_batch"), record.get("micro_batch"),
                   run.name, record.get("device"), run.attention, run.fused_mlp, run.fused_gated_bias_mlp,
                   run.grouped_experts, run.fused_cross_entropy, run.quack_loss,
                   TRITON_ATTENTION_INPUT in json.dumps(record.get("attention")))
            if key not in latest or latest[key][1].get("date", "") <= record.get("date", ""):
                latest[key] = (path, record)
    return list(latest.values())


def predict_record_memory(record: dict, layouts: Path, calibration: Calibration) -> tuple[Run, float] | None:
    """(the run, the planner's peak memory per GPU in GB) of a bench_e2e record, or None where the
    planner does not model its layout (record_run)."""
    run = record_run(record, layouts)
    if run is None:
        return None
    (group,) = measured_groups([record], layouts, trainer_vocab_size()).values()
    return run, predict_run(run, group, calibration).memory_gb


def in_memory_band(predicted_gb: float, measured_gb: float) -> bool:
    return measured_gb - MEMORY_UNDER_GB <= predicted_gb <= measured_gb * (1 + MEMORY_OVER_SHARE)


@dataclass
class Check:
    """A group's runs predicted: (run, prediction) pairs, the measured and predicted rankings (run
    labels, fastest first; out of memory / over memory apart), and the gain of the best
    heterogeneous layout over the best homogeneous one, measured and predicted (None: a side
    without a run)."""

    rows: list
    measured: list[str]
    predicted: list[str]
    measured_gain: float | None
    predicted_gain: float | None

    @property
    def agree(self) -> bool:
        over = sorted(r.label for r, p in self.rows if not p.fits)
        oom = sorted(r.label for r, _ in self.rows if r.tokens_per_s is None)
        return self.measured == self.predicted and over == oom

    def largest_misranked_gap(self) -> float:
        """Over the pairs of measured runs that the prediction ranks the other way, the largest
        measured tokens/s ratio less 1 (0: none): how far apart the runs it swaps really are."""
        rate = {r.label: r.tokens_per_s for r, _ in self.rows if r.tokens_per_s is not None}
        place = {label: n for n, label in enumerate(self.predicted)}
        ranked = [label for label in self.measured if label in place]  # fastest first
        return max((rate[a] / rate[b] - 1 for n, a in enumerate(ranked) for b in ranked[n + 1:]
                    if place[a] > place[b]), default=0.0)


def _gain(ranked: list[tuple[Run, float]], rate) -> float | None:
    """The best heterogeneous run's rate over the best homogeneous one's, less 1."""
    homogeneous = [rate(r, p) for r, p in ranked if p.candidate.placement == "homogeneous"]
    heterogeneous = [rate(r, p) for r, p in ranked if p.candidate.placement != "homogeneous"]
    if not homogeneous or not heterogeneous:
        return None
    return max(heterogeneous) / max(homogeneous) - 1


def check(group: Group, base: Calibration, leave_one_out: bool = False) -> Check:
    """Every run of the group predicted from the calibration fitted to the group (with
    `leave_one_out`, to its other runs), the rankings and the gains."""
    fitted = fit([group], base)
    rows = []
    for run in group.runs:
        others = replace(group, runs=[r for r in group.runs if r is not run])
        rows.append((run, predict_run(run, group, fit([others], base) if leave_one_out else fitted)))
    measured = sorted(((r, p) for r, p in rows if r.tokens_per_s is not None), key=lambda rp: -rp[0].tokens_per_s)
    predicted = sorted(((r, p) for r, p in rows if p.fits), key=lambda rp: rp[1].step_s)
    return Check(rows, [r.label for r, _ in measured], [r.label for r, _ in predicted],
                 _gain(measured, lambda r, p: r.tokens_per_s), _gain(predicted, lambda r, p: p.tokens_per_s))


def left_out_errors(seen: list[Observation], base: Calibration) -> dict[LayerKey, float]:
    """Per observed layer shape and layout, how far the curve fitted without it lands from its
    measurements: the mean over its observations of predicted / measured time - 1."""
    errors = {}
    for key in sorted({o.key for o in seen}, key=LayerKey.describe):
        curve = fit_curve([o for o in seen if o.key != key], base)
        errors[key] = statistics.mean(o.curve_s(curve) / o.measured_s - 1 for o in seen if o.key == key)
    return errors
