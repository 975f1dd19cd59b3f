"""The plan: every candidate predicted, the fastest micro batch size of each layout, ranked, each
with its reason."""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_hetero.planner.calibration import Calibration
from megatron_hetero.planner.candidates import Candidate, Recompute, enumerate_candidates
from megatron_hetero.planner.cost import CostModel, Prediction
from megatron_hetero.planner.output import explain
from megatron_hetero.planner.shapes import Cluster, Workload


@dataclass
class Plan:
    """One prediction per layout combination (its fastest micro batch size), fastest first: those
    that fit in memory, and those that do not (the fastest micro batch size of each)."""

    ranked: list[Prediction]
    over_memory: list[Prediction]

    def best(self, placement: str | None = None) -> Prediction | None:
        return next((p for p in self.ranked if placement in (None, p.candidate.placement)), None)


def least_recompute(model: CostModel, candidate: Candidate) -> Prediction:
    """The candidate with the fewest recomputed layers per stage that fits (Megatron's block method;
    memory falls and time rises with every layer recomputed, so the fewest that fit is the fastest
    that fits), found by bisection; a candidate without recomputation, or one whose full
    recomputation does not fit, as it is."""
    full = model.predict(candidate)
    if candidate.recompute is None or not full.fits:
        return full
    low, high, best = 1, candidate.recompute.of, full  # best fits with `high` layers
    while low < high:
        middle = (low + high) // 2
        trial = model.predict(replace(candidate, recompute=Recompute(middle, candidate.recompute.of)))
        if trial.fits:
            high, best = middle, trial
        else:
            low = middle + 1
    return best


def best_micro_batch(model: CostModel, group: list[Candidate]) -> Prediction:
    """The fastest of a layout's micro batch sizes (each with the fewest recomputed layers that
    fit) that fits in memory, else the one that comes closest to fitting."""
    predictions = [least_recompute(model, c) for c in group]
    fitting = [p for p in predictions if p.fits]
    if fitting:
        return min(fitting, key=lambda p: (p.step_s, p.memory_gb))
    return min(predictions, key=lambda p: (p.memory_gb, p.step_s))


def plan(workload: Workload, cluster: Cluster, calibration: Calibration) -> Plan:
    """Predict every candidate, rank, and give every prediction its reason (against the best
    homogeneous layout that fits)."""
    model = CostModel(workload, cluster, calibration)
    predictions = [best_micro_batch(model, group) for group in enumerate_candidates(workload, cluster) if group]
    predictions.sort(key=lambda p: (p.step_s, p.memory_gb))
    fitting = [p for p in predictions if p.fits]
    reference = next((p for p in fitting if p.candidate.placement == "homogeneous"), None)
    capacity = cluster.gpu_memory_gb * calibration.usable_memory_fraction
    explained = [replace(p, reason=explain(p, reference, workload, capacity)) for p in predictions]
    return Plan([p for p in explained if p.fits], [p for p in explained if not p.fits])
