"""Layout planner: an analytic cost model that predicts step time and memory per GPU for every valid
layout of a multimodal workload, colocated, non-colocated and Megatron's homogeneous baseline.

Pure Python (no torch): `megatron-hetero plan` (cli/plan.py) is its command line. Every figure is a prediction
from formulas and a calibration; the assumptions are stated where they are used.

The model, per training step:
- compute: FLOPs per module from its weights (2 FLOPs per weight per token forward) plus attention
  (4 x attended keys x hidden per token), backward = 2 x forward, a frozen module runs forward only;
  divided over the GPUs that share the work and run at `matmul_tflops x efficiency`, where the
  efficiency drops as TP narrows each GPU's GEMMs (a curve fitted to measured runs), or from a
  measured per-layer time where one was measured for the layer's shape and layout;
- communication: TP (2 all-reduces per layer forward, 2 backward, or the equal-cost all-gather +
  reduce-scatter pairs of sequence parallelism), CP (the K/V all-gather of each layer forward, a
  reduce-scatter of dK/dV backward), the DP gradient all-reduce over DP x CP (not overlapped, as the
  trainer runs it), pipeline sends, the boundary (encoder rows to the LLM, gradients back); nothing
  overlaps with compute;
- schedule: colocated LLM pp=1 runs encoder forward, LLM forward/backward and encoder backward per
  microbatch; colocated LLM pp>1 adds the LLM's 1F1B bubble and one recomputed encoder forward;
  non-colocated is one 1F1B pipeline of encoder stages then LLM stages, whose slowest stage sets the
  pace; the homogeneous baseline puts the encoders, with the LLM's TP (replicated over its CP), on
  the LLM's first pipeline stage; a colocated encoder may run one pass over k microbatches (layout
  `microbatches`: its items of k microbatches balanced over its DP ranks, k times its busiest
  rank's items and activations per pass), k chosen per layout up to the k that fills every rank;
- memory per GPU: under Megatron's --bf16, bf16 weights, fp32 gradients, fp32 main params and Adam
  moments (18 bytes per trainable parameter; the distributed optimizer shards the 12 optimizer
  bytes over DP x CP; a frozen module keeps its 2-byte weights only), plus activations (times a
  factor fitted to measured peaks, by module role and attention kernel where the workload names
  the kernel) for the microbatches 1F1B keeps in flight, the LLM's logits as the loss holds them, and
  once (one layer at a time) an MoE LLM's grouped experts' weight gradient with its fp32 copies;
- recomputation (Megatron's block method, where the workload allows it): the first k layers of each
  stage keep only their input and run their forward again in the backward; the search takes the
  fewest k that fit.

Modules: `shapes` (module shapes, workloads, clusters), `counts` (parameters, FLOPs, activation
bytes), `calibration` (hardware figures), `candidates` (the layouts the rules allow), `cost` (the
cost model), `search` (the ranked plan), `output` (reasons and layout files), `presets` (the
workload table the tools share), `families` (the VLM families' presets, counted as their models run),
`fit` (the calibration fitted to measured runs).
"""

from megatron_hetero.planner.calibration import Calibration
from megatron_hetero.planner.candidates import Candidate, candidate_from_layout, enumerate_candidates, layout_problem
from megatron_hetero.planner.cost import CostModel, Prediction, Seconds
from megatron_hetero.planner.counts import model_flops_per_step, module_forward_flops_per_sample, module_params
from megatron_hetero.planner.output import explain, layout_yaml
from megatron_hetero.planner.presets import (
    BENCH_WORKLOADS,
    PRESETS,
    BenchWorkload,
    Preset,
    model_flops,
    trainer_workload,
)
from megatron_hetero.planner.search import Plan, best_micro_batch, plan
from megatron_hetero.planner.shapes import H200_MEMORY_GB, Cluster, ModuleShape, Workload

__all__ = [
    "BENCH_WORKLOADS",
    "H200_MEMORY_GB",
    "PRESETS",
    "BenchWorkload",
    "Calibration",
    "Candidate",
    "Cluster",
    "CostModel",
    "ModuleShape",
    "Plan",
    "Prediction",
    "Preset",
    "Seconds",
    "Workload",
    "best_micro_batch",
    "candidate_from_layout",
    "enumerate_candidates",
    "explain",
    "layout_problem",
    "layout_yaml",
    "model_flops",
    "model_flops_per_step",
    "module_params",
    "module_forward_flops_per_sample",
    "plan",
    "trainer_workload",
]
