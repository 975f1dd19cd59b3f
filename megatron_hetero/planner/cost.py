"""The cost model: seconds per step on the busiest GPU, by component, and memory per GPU, of one
candidate (the model is stated in megatron_hetero.planner's docstring)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from megatron_hetero.planner.calibration import Calibration, LayerKey
from megatron_hetero.planner.candidates import Candidate
from megatron_hetero.planner.counts import (
    GRADIENT_BYTES,
    activation_bytes_per_token_layer,
    bytes_per_logit,
    expert_layer_params,
    experts_run_grouped,
    grouped_experts_transient_bytes,
    head_forward_flops_per_sample,
    head_params,
    layer_forward_flops_per_token,
    layer_params,
    mlp_runs_fused,
    model_flops_per_step,
    optimizer_bytes,
)
from megatron_hetero.planner.shapes import Cluster, ModuleShape, Workload
from megatron_hetero.spec.layout import ModuleLayout

GB = 1e9


def split_cp(shape: ModuleShape, layout: ModuleLayout) -> int:
    """The CP size that splits the module's sequence: the LLM's cp; an encoder's its items' tokens
    (but for cp_replicated, the homogeneous baseline's, which replicates each item)."""
    return layout.sequence_cp


def gpu_tokens(shape: ModuleShape, layout: ModuleLayout, samples: float) -> float:
    """The module's tokens of `samples` samples on one GPU of its layout (its sequence split by CP)."""
    return samples * shape.tokens_per_sample / split_cp(shape, layout)


def layer_key(shape: ModuleShape, layout: ModuleLayout) -> LayerKey:
    """The key of a measured time for this module's layers under this layout."""
    return LayerKey.of(shape, layout.tp, split_cp(shape, layout))


def recomputed_layers(shape: ModuleShape, layout: ModuleLayout, candidate: Candidate) -> int:
    """Layers of one pipeline stage of the module that recompute their forward in the backward (a
    frozen module runs without a graph: none)."""
    if candidate.recompute is None or shape.frozen:
        return 0
    return candidate.recompute.of_stage(shape.layers // layout.pp)


def encoder_forward_reruns(placement: str, llm: ModuleLayout) -> bool:
    """Whether a trainable encoder runs its forward twice per microbatch: colocated with a pipelined
    LLM, the schedule runs it without a graph for the LLM pipeline, then again for its backward."""
    return placement == "colocated" and llm.pp > 1


@dataclass(frozen=True)
class Seconds:
    """Time one GPU spends, by component."""

    compute: float = 0.0
    tp_comm: float = 0.0
    cp_comm: float = 0.0
    p2p: float = 0.0  # pipeline sends between stages
    boundary: float = 0.0  # encoder rows to the LLM and their gradients back
    dp_sync: float = 0.0  # gradient all-reduce over DP x CP
    ep_comm: float = 0.0  # an MoE layer's token all-to-alls over EP (dispatch and combine)

    def __add__(self, other: Seconds) -> Seconds:
        return Seconds(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __mul__(self, k: float) -> Seconds:
        return Seconds(*(getattr(self, f.name) * k for f in fields(self)))

    __rmul__ = __mul__

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    step_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    memory_gb: float
    fits: bool
    busy: dict  # module name -> Seconds: what the critical GPU does per step
    idle_s: float  # what the critical GPU waits per step: pipeline bubble, stage imbalance
    stage_s: dict  # module name -> seconds of one pipeline stage per microbatch (forward + backward)
    # Modules whose layers the efficiency curve prices although the calibration has measured
    # layer times: none of them is for this module's shape and layout.
    curve_modules: tuple[str, ...] = ()
    reason: str = ""


class CostModel:
    """Predictions for one workload on one cluster with one calibration."""

    def __init__(self, workload: Workload, cluster: Cluster, calibration: Calibration):
        self.workload, self.cluster, self.calibration = workload, cluster, calibration
        self.shapes = {shape.name: shape for shape in workload.modules}
        self._passes = {}

    # -- links and collectives ---------------------------------------------------------------

    def _gbps(self, size: int, stride: int, inside_node: float) -> float:
        """Bandwidth of a group of `size` ranks `stride` apart: the node's links when the group fits
        in one node, else the network (assumption: ranks are numbered node by node, and a group that
        crosses nodes runs at the network's per-GPU bandwidth)."""
        return inside_node if size * stride <= self.cluster.gpus_per_node else self.calibration.network_gbps

    def _latency(self) -> float:
        return self.calibration.collective_latency_us * 1e-6

    def all_reduce_s(self, nbytes: float, size: int, stride: int) -> float:
        """Ring all-reduce: each GPU moves 2 (size-1)/size of the buffer at the bus bandwidth."""
        if size == 1:
            return 0.0
        gbps = self._gbps(size, stride, self.calibration.nvlink_gbps)
        return self._latency() + 2 * (size - 1) / size * nbytes / (gbps * GB)

    def all_gather_s(self, out_bytes: float, size: int, stride: int) -> float:
        """All-gather (or reduce-scatter) of an `out_bytes` result: (size-1)/size of it moves."""
        if size == 1:
            return 0.0
        gbps = self._gbps(size, stride, self.calibration.nvlink_gbps)
        return self._latency() + (size - 1) / size * out_bytes / (gbps * GB)

    def all_to_all_s(self, nbytes: float, size: int, stride: int) -> float:
        """All-to-all of `nbytes` per GPU: (size-1)/size of it leaves the GPU."""
        if size == 1:
            return 0.0
        gbps = self._gbps(size, stride, self.calibration.nvlink_gbps)
        return self._latency() + (size - 1) / size * nbytes / (gbps * GB)

    def expert_dispatch(self, shape: ModuleShape, layout: ModuleLayout, tokens: float) -> Seconds:
        """An MoE layer's forward all-to-alls over `tokens` tokens of one GPU: every token's topk
        copies to the EP ranks of their experts and back (megatron-core's alltoall dispatcher;
        tokens split over TP with sequence parallelism). EP groups are strided by expert TP (= tp)."""
        if not shape.experts:
            return Seconds()
        nbytes = tokens * shape.topk * shape.hidden * self.workload.dtype_bytes / (layout.tp if layout.sp else 1)
        return Seconds(ep_comm=2 * self.all_to_all_s(nbytes, layout.ep, layout.etp))

    def send_s(self, nbytes: float, distance: int) -> float:
        """One point-to-point send to a rank `distance` away."""
        gbps = self._gbps(2, distance, self.calibration.p2p_gbps)
        return self._latency() + nbytes / (gbps * GB)

    # -- one microbatch through one module -------------------------------------------------------

    def efficiency(self, shape: ModuleShape, tp: int) -> float:
        """The calibration's efficiency curve at the GEMM width one GPU gets: hidden / tp."""
        return self.calibration.efficiency(shape.hidden / tp)

    def measured_layer_us(self, shape: ModuleShape, layout: ModuleLayout) -> float | None:
        """The calibration's measured time per token of one layer of this shape under this layout,
        or None."""
        return self.calibration.layer_forward_us_per_token.get(layer_key(shape, layout))

    def layer_forward(self, shape: ModuleShape, tp: int, tokens: float) -> Seconds:
        """One layer's forward over `tokens` tokens on one GPU of a TP group, from the efficiency
        curve: compute and the two TP collectives (all-reduces; with sequence parallelism an
        all-gather and a reduce-scatter, the same bytes)."""
        flops = tokens * layer_forward_flops_per_token(shape) / tp
        compute = flops / (self.calibration.matmul_tflops * 1e12 * self.efficiency(shape, tp))
        nbytes = tokens * shape.hidden * self.workload.dtype_bytes
        return Seconds(compute=compute, tp_comm=2 * self.all_reduce_s(nbytes, tp, 1))

    def head_forward_s(self, shape: ModuleShape, layout: ModuleLayout, samples: float) -> float:
        """The head (an encoder's projector, the LLM's output layer) over `samples` samples on one
        GPU: its FLOPs split over TP (and the LLM's CP), at the efficiency curve."""
        shares = layout.tp * split_cp(shape, layout)
        flops = samples * head_forward_flops_per_sample(shape, self.workload.llm.hidden) / shares
        return flops / (self.calibration.matmul_tflops * 1e12 * self.efficiency(shape, layout.tp))

    def microbatch_pass(self, shape: ModuleShape, layout: ModuleLayout, samples: float,
                        recomputed: int) -> tuple[Seconds, Seconds]:
        """(forward, backward) of `samples` samples through the whole module (all its layers; a
        pipeline stage does 1/pp of it) on one GPU of one DP replica. The LLM splits each sequence
        over CP, an encoder each item (split_cp), each query still attending to every key of the
        sequence or item: the attention's FLOPs split with the tokens. A measured time for the
        layer's shape and layout replaces the curve and the TP and CP communication. Backward: 2 x
        the forward FLOPs (input and weight gradients) and the same collectives in reverse (TP: two
        per layer; CP: a reduce-scatter of dK and dV); with `recomputed` layers of each stage
        recomputing, their forward once more."""
        key = (shape.name, layout.tp, layout.cp, layout.ep, layout.pp, samples, recomputed)
        if key not in self._passes:
            cp = split_cp(shape, layout)
            tokens = samples * shape.tokens_per_sample / cp
            measured = self.measured_layer_us(shape, layout)
            if measured is not None:
                layer = Seconds(compute=measured * 1e-6 * tokens)
            else:
                kv_bytes = cp * tokens * 2 * shape.kv_dim / layout.tp * self.workload.dtype_bytes
                layer = self.layer_forward(shape, layout.tp, tokens) + Seconds(
                    cp_comm=self.all_gather_s(kv_bytes, cp, layout.tp))
            layer += self.expert_dispatch(shape, layout, tokens)
            forward = shape.layers * layer + Seconds(compute=self.head_forward_s(shape, layout, samples))
            backward = Seconds(compute=2 * forward.compute, tp_comm=forward.tp_comm, cp_comm=forward.cp_comm,
                               ep_comm=forward.ep_comm)
            backward += recomputed * layout.pp * layer
            self._passes[key] = (forward, backward)
        return self._passes[key]

    def stage_pass(self, shape: ModuleShape, layout: ModuleLayout, samples: float,
                   recomputed: int) -> tuple[Seconds, Seconds]:
        """(forward, backward) of one pipeline stage for one microbatch: 1/pp of the module (the
        embedding and output layer spread evenly, as if balanced) plus, with pp > 1, the send of
        its activations (its gradients backward) to the neighbouring stage."""
        forward, backward = self.microbatch_pass(shape, layout, samples, recomputed)
        if layout.pp == 1:
            return forward, backward
        nbytes = (gpu_tokens(shape, layout, samples) * shape.hidden * self.workload.dtype_bytes
                  / (layout.tp if layout.sp else 1))
        send = Seconds(p2p=self.send_s(nbytes, layout.tp * layout.cp * layout.dp))
        return forward * (1 / layout.pp) + send, backward * (1 / layout.pp) + send

    def dp_sync_s(self, shape: ModuleShape, layout: ModuleLayout) -> float:
        """The fp32 gradient all-reduce of a trainable module over its DP x CP group, once per step
        (reduce-scatter + all-gather with the distributed optimizer: the same bytes); an MoE
        layer's experts over their expert DP group instead."""
        if shape.frozen:
            return 0.0
        experts = self.stage_expert_params(shape, layout)
        dense = self.stage_params(shape, layout) - experts
        return (self.all_reduce_s(dense * GRADIENT_BYTES, layout.dp * layout.cp, layout.tp)
                + self.all_reduce_s(experts * GRADIENT_BYTES, layout.expert_dp, layout.etp * layout.ep))

    # -- memory ---------------------------------------------------------------------------------

    def stage_params(self, shape: ModuleShape, layout: ModuleLayout) -> float:
        """Parameters on one GPU of the module's heaviest stage: its layers, plus the embedding and
        output layer (both with pp=1, one of them on the first or last stage), or the projector."""
        head = head_params(shape, self.workload.llm.hidden)
        if shape.role == "llm" and layout.pp > 1:
            head /= 2
        dense = shape.layers // layout.pp * (layer_params(shape) - expert_layer_params(shape)) + head
        return dense / layout.tp + self.stage_expert_params(shape, layout)

    def stage_expert_params(self, shape: ModuleShape, layout: ModuleLayout) -> float:
        """The experts' parameters on one GPU of a stage: split over EP and expert TP."""
        return shape.layers // layout.pp * expert_layer_params(shape) / (layout.ep * layout.etp)

    def static_bytes(self, shape: ModuleShape, layout: ModuleLayout) -> float:
        """Weights, gradients and optimizer state on one GPU (the distributed optimizer shards the
        main params and Adam moments over DP x CP, an MoE layer's experts' over expert DP; a frozen
        module keeps its weights only)."""
        params, weight = self.stage_params(shape, layout), self.workload.weight_bytes
        if shape.frozen:
            return params * weight
        experts = self.stage_expert_params(shape, layout)  # sharded over their expert DP group
        sharded = self.workload.distributed_optimizer
        dense_shards, expert_shards = (layout.dp * layout.cp, layout.expert_dp) if sharded else (1, 1)
        optimizer = optimizer_bytes(weight)
        return ((params - experts) * (weight + GRADIENT_BYTES + optimizer / dense_shards)
                + experts * (weight + GRADIENT_BYTES + optimizer / expert_shards))

    def activation_bytes(self, shape: ModuleShape, layout: ModuleLayout, samples: float, recomputed: int) -> float:
        """Activations one microbatch leaves on one GPU of a stage for its backward (none for a
        frozen module, which runs without a graph): a recomputed layer keeps its input (what it holds
        again in its backward: backward_bytes), the others their full activations, times the
        calibration's measured factor for the module's role and attention kernel. The LLM adds its
        logits as the loss holds them (counts.bytes_per_logit: megatron-core's cross entropy, its fused
        one or quack's as the workload says; a count the factor does not scale; counted on every stage:
        conservative for the first)."""
        if shape.frozen:
            return 0.0
        tokens = gpu_tokens(shape, layout, samples)
        layer_input = shape.hidden * self.workload.dtype_bytes / (layout.tp if layout.sp else 1)
        kept = shape.layers // layout.pp - recomputed
        kept_bytes = tokens * (recomputed * layer_input + kept * self._layer_bytes_per_token(shape, layout, tokens))
        return kept_bytes * self._factor(shape) + self.logit_bytes(shape, layout, samples)

    def _factor(self, shape: ModuleShape) -> float:
        """The calibration's measured activation factor for the module's role and attention kernel."""
        return self.calibration.activation_factor(shape.role, self.workload.attention_of(shape.name)[0])

    def _layer_bytes_per_token(self, shape: ModuleShape, layout: ModuleLayout, tokens: float) -> float:
        """One layer's full activations per token (counts.activation_bytes_per_token_layer)."""
        fused = mlp_runs_fused(shape, tokens, layout.tp, self.workload.fused_mlp, self.workload.fused_gated_bias_mlp)
        kernel, head_dim = self.workload.attention_of(shape.name)
        return activation_bytes_per_token_layer(shape, layout.tp, layout.sp, self.workload.dtype_bytes, fused,
                                                head_dim, kernel)

    def logit_bytes(self, shape: ModuleShape, layout: ModuleLayout, samples: float) -> float:
        """The logits of one microbatch as the loss holds them (the LLM's; 0 for an encoder)."""
        if shape.role != "llm":
            return 0.0
        per_logit = bytes_per_logit(self.workload.fused_cross_entropy, self.workload.quack_cross_entropy, layout.tp)
        return gpu_tokens(shape, layout, samples) * shape.vocab / layout.tp * per_logit

    def backward_bytes(self, shape: ModuleShape, layout: ModuleLayout, samples: float, recomputed: int) -> float:
        """What one layer's backward holds at once on top of a stage's activations, once per GPU (not per
        layer or microbatch; `samples` a microbatch's): with every layer of the stage recomputed, the
        layer's activations rebuilt and about as many bytes of their gradients (twice one layer's, times
        the factor); an MoE LLM's grouped experts' short-lived tensors (counts.grouped_experts_transient_bytes)."""
        workload, held = self.workload, 0.0
        if recomputed and recomputed == shape.layers // layout.pp:
            tokens = gpu_tokens(shape, layout, samples)
            held = 2 * tokens * self._layer_bytes_per_token(shape, layout, tokens) * self._factor(shape)
        if experts_run_grouped(shape, layout.etp, layout.ep, workload.weight_bytes, workload.grouped_experts):
            held += grouped_experts_transient_bytes(shape, layout.etp, layout.ep, workload.dtype_bytes)
        return held

    def beyond_logits(self, backward: float, layout: ModuleLayout, samples: float) -> float:
        """Of what a backward holds (backward_bytes), what adds to the peak of a GPU whose activations
        count the LLM's logits (under `layout`, `samples` a microbatch's): the backward runs after the loss
        has freed them."""
        return max(0.0, backward - self.logit_bytes(self.workload.llm, layout, samples))

    def rows_bytes(self, samples: float, encoder: ModuleShape | None = None) -> float:
        """Boundary rows of `samples` samples: `encoder`'s (None: every encoder's) rows at the LLM
        hidden size, DeepStack rows beside the main ones."""
        encoders = self.workload.encoders if encoder is None else (encoder,)
        rows = samples * sum(e.rows_per_sample * e.row_width for e in encoders)
        return rows * self.workload.llm.hidden * self.workload.dtype_bytes

    # -- boundary ---------------------------------------------------------------------------------

    def _boundary_s(self, nbytes: float, gbps: float, trainable: bool) -> float:
        calls = 2 if trainable else 1  # rows forward; gradients back for a trainable encoder
        return calls * (self.calibration.boundary_call_ms * 1e-3 + nbytes / (gbps * GB))

    def colocated_boundary_s(self, shape: ModuleShape, candidate: Candidate) -> float:
        """One microbatch's re-layout of one encoder's rows on one GPU: its share of the rows
        arrives (the planned minimum: with sequence parallelism each row reaches one LLM rank of the
        first stage; without it, the TP replicas), at the measured re-layout throughput. Inside a
        node unless LLM pp > 1 gathers every GPU's rows onto the first stage across nodes."""
        llm = candidate.llm
        stage_ranks = llm.tp * llm.cp * llm.dp
        replicas = 1 if llm.sp else llm.tp
        nbytes = self.rows_bytes(candidate.micro_batch * llm.dp, shape) * replicas / stage_ranks
        crosses_nodes = llm.pp > 1 and self.cluster.gpus > self.cluster.gpus_per_node
        gbps = self.calibration.network_gbps if crosses_nodes else self.calibration.boundary_gbps
        return self._boundary_s(nbytes, gbps, not shape.frozen)

    def non_colocated_boundary_s(self, shape: ModuleShape, layout: ModuleLayout, candidate: Candidate) -> float:
        """One microbatch's rows from an encoder's last stage to the LLM's first, point to point;
        the busier end (the encoder GPUs sending, spread over its TP ranks, each CP rank its part
        of the rows, or the LLM GPUs receiving) sets the time. Ranks of another module are taken as
        one node away unless the whole cluster is one node."""
        llm = candidate.llm
        rows = self.rows_bytes(candidate.micro_batch * llm.dp, shape)
        nbytes = max(rows / (layout.dp * layout.tp * split_cp(shape, layout)), rows / (llm.tp * llm.cp * llm.dp))
        one_node = self.cluster.gpus <= self.cluster.gpus_per_node
        gbps = self.calibration.p2p_gbps if one_node else self.calibration.network_gbps
        return self._boundary_s(nbytes, gbps, not shape.frozen)

    # -- placements ---------------------------------------------------------------------------------

    def microbatches(self, candidate: Candidate) -> int:
        return self.workload.global_batch // (candidate.micro_batch * candidate.llm.dp)

    def encoder_samples(self, candidate: Candidate, layout: ModuleLayout) -> float:
        """Samples' worth of items the busiest encoder DP replica runs per pass: the items of every
        LLM DP rank's microbatch (micro batch x llm dp samples), of each microbatch of the pass
        (layout `microbatches`), balanced over the encoder's DP ranks, whole items each
        (boundary/balance.py): a pass of more microbatches leaves fewer ranks idle and pays each
        collective's latency once; in the homogeneous baseline, the micro batch of its own LLM DP
        replica."""
        if candidate.placement == "homogeneous":
            return candidate.micro_batch
        per_sample = self.shapes[layout.name].items_per_sample
        items = candidate.micro_batch * candidate.llm.dp * per_sample * layout.microbatches
        return math.ceil(items / layout.dp) / per_sample

    def predict(self, candidate: Candidate) -> Prediction:
        step = {"colocated": self._colocated, "non_colocated": self._non_colocated,
                "homogeneous": self._homogeneous}[candidate.placement]
        busy, idle, stage_s, memory = step(candidate)
        step_s = sum(s.total for s in busy.values()) + idle
        workload = self.workload
        capacity = self.cluster.gpu_memory_gb * self.calibration.usable_memory_fraction
        tflops_per_gpu = model_flops_per_step(workload) / step_s / self.cluster.gpus / 1e12
        # Every GPU does its share of the FLOPs at or below the ceiling (the curve's efficiency is
        # at most 1, a measured time is refused when faster), and waits or communicates besides.
        assert tflops_per_gpu <= self.calibration.matmul_tflops * (1 + 1e-9), (candidate.describe(), tflops_per_gpu)
        measured = self.calibration.layer_forward_us_per_token
        curve = tuple(layout.name for layout in candidate.layouts
                      if measured and self.measured_layer_us(self.shapes[layout.name], layout) is None)
        return Prediction(
            candidate=candidate,
            step_s=step_s,
            tokens_per_s=workload.global_batch * workload.llm.seq_length / step_s,
            tflops_per_gpu=tflops_per_gpu,
            memory_gb=memory / GB,
            fits=memory / GB <= capacity,
            busy=busy,
            idle_s=idle,
            stage_s=stage_s,
            curve_modules=curve,
        )

    def _encoder_step(self, candidate: Candidate) -> tuple[dict, float, float, float]:
        """Encoders on every GPU of theirs over a step: (busy by module, static bytes, activation
        bytes of one pass, the most one of their layers' backward holds: backward_bytes). A trainable
        encoder runs forward and backward per pass (a microbatch, or `microbatches` of them), and its
        forward once more when the colocated LLM is pipelined (the schedule reruns it with its graph
        after the LLM pipeline); its rows cross the boundary per microbatch."""
        m = self.microbatches(candidate)
        rerun_forward = encoder_forward_reruns(candidate.placement, candidate.llm)
        busy, static, activations, held_back = {}, 0.0, 0.0, 0.0
        for layout in candidate.encoders:
            shape = self.shapes[layout.name]
            samples = self.encoder_samples(candidate, layout)
            recomputed = recomputed_layers(shape, layout, candidate)
            forward, backward = self.microbatch_pass(shape, layout, samples, recomputed)
            per_pass = forward if shape.frozen else forward * (2 if rerun_forward else 1) + backward
            busy[layout.name] = m // layout.microbatches * per_pass + Seconds(dp_sync=self.dp_sync_s(shape, layout))
            if candidate.placement == "colocated":
                busy[layout.name] += m * Seconds(boundary=self.colocated_boundary_s(shape, candidate))
            static += self.static_bytes(shape, layout)
            activations += self.activation_bytes(shape, layout, samples, recomputed)
            held_back = max(held_back, self.backward_bytes(shape, layout, samples, recomputed))
        return busy, static, activations, held_back

    def _colocated(self, candidate: Candidate):
        llm_shape, llm = self.workload.llm, candidate.llm
        m = self.microbatches(candidate)
        busy, static, encoder_activations, encoder_backward = self._encoder_step(candidate)
        recomputed = recomputed_layers(llm_shape, llm, candidate)
        forward, backward = self.stage_pass(llm_shape, llm, candidate.micro_batch, recomputed)
        stage = forward + backward
        busy[llm.name] = m * stage + Seconds(dp_sync=self.dp_sync_s(llm_shape, llm))
        idle = (llm.pp - 1) * stage.total  # the LLM's 1F1B fill and drain
        in_flight = min(llm.pp, m)
        llm_activations = in_flight * self.activation_bytes(llm_shape, llm, candidate.micro_batch, recomputed)
        held_back = max(encoder_backward, self.backward_bytes(llm_shape, llm, candidate.micro_batch, recomputed))
        # With pp > 1 the encoders' rows for every microbatch wait for the LLM pipeline; the
        # encoders' activations exist only during their recompute, after it.
        rows = m * self.rows_bytes(candidate.micro_batch * llm.dp) / self.cluster.gpus if llm.pp > 1 else 0.0
        peak = (rows + (max if llm.pp > 1 else sum)((encoder_activations, llm_activations))
                + self.beyond_logits(held_back, llm, candidate.micro_batch))
        memory = static + self.static_bytes(llm_shape, llm) + peak
        return busy, idle, {llm.name: stage.total}, memory

    def _homogeneous(self, candidate: Candidate):
        llm_shape, llm = self.workload.llm, candidate.llm
        m = self.microbatches(candidate)
        busy, static, encoder_activations, encoder_backward = self._encoder_step(candidate)
        recomputed = recomputed_layers(llm_shape, llm, candidate)
        forward, backward = self.stage_pass(llm_shape, llm, candidate.micro_batch, recomputed)
        stage = (forward + backward).total
        encoders = sum(s.total - s.dp_sync for s in busy.values()) / m
        # 1F1B with unequal stages: fill and drain through every stage, then the slowest stage
        # (the first, which also runs the encoders) paces the remaining m - 1 microbatches.
        stages = [stage + encoders] + [stage] * (llm.pp - 1)
        pipeline = sum(stages) + (m - 1) * max(stages)
        busy[llm.name] = m * (forward + backward) + Seconds(dp_sync=self.dp_sync_s(llm_shape, llm))
        idle = pipeline - m * stages[0]
        in_flight = min(llm.pp, m)
        held_back = max(encoder_backward, self.backward_bytes(llm_shape, llm, candidate.micro_batch, recomputed))
        memory = (static + self.static_bytes(llm_shape, llm) + self.beyond_logits(held_back, llm, candidate.micro_batch)
                  + in_flight * (encoder_activations
                                 + self.activation_bytes(llm_shape, llm, candidate.micro_batch, recomputed)))
        return busy, idle, {llm.name: stage, "first stage": stages[0]}, memory

    def _non_colocated(self, candidate: Candidate):
        llm_shape, llm = self.workload.llm, candidate.llm
        m, recomputed = self.microbatches(candidate), recomputed_layers(llm_shape, llm, candidate)
        llm_forward, llm_backward = self.stage_pass(llm_shape, llm, candidate.micro_batch, recomputed)
        llm_stage = llm_forward + llm_backward
        stage_s = {llm.name: llm_stage.total}
        held_back = self.backward_bytes(llm_shape, llm, candidate.micro_batch, recomputed)
        memory = (self.static_bytes(llm_shape, llm) + self.beyond_logits(held_back, llm, candidate.micro_batch)
                  + min(llm.pp, m) * self.activation_bytes(llm_shape, llm, candidate.micro_batch, recomputed))
        encoder_depth, dp_sync = 0.0, self.dp_sync_s(llm_shape, llm)
        for layout in candidate.encoders:
            shape = self.shapes[layout.name]
            samples = self.encoder_samples(candidate, layout)
            encoder_recomputed = recomputed_layers(shape, layout, candidate)
            forward, backward = self.stage_pass(shape, layout, samples, encoder_recomputed)
            stage = (forward if shape.frozen else forward + backward).total
            # The boundary transfer belongs to the encoder's last stage (the LLM's first waits for it).
            last_stage = stage + self.non_colocated_boundary_s(shape, layout, candidate)
            stage_s[layout.name] = last_stage
            encoder_depth = max(encoder_depth, (layout.pp - 1) * stage + last_stage)
            dp_sync = max(dp_sync, self.dp_sync_s(shape, layout))
            # The first encoder stage keeps a microbatch in flight for every stage after it; a
            # frozen encoder runs ahead, its rows queued for the LLM.
            in_flight = min(layout.pp + llm.pp, m)
            queued = m * self.rows_bytes(candidate.micro_batch * llm.dp) / layout.size if shape.frozen else 0.0
            memory = max(memory, self.static_bytes(shape, layout) + queued
                         + in_flight * self.activation_bytes(shape, layout, samples, encoder_recomputed)
                         + self.backward_bytes(shape, layout, samples, encoder_recomputed))
        # One 1F1B pipeline: the encoder stages (branches in parallel) then the LLM's; the slowest
        # stage paces the remaining m - 1 microbatches. The critical GPU is an LLM GPU; DP syncs of
        # different modules run at once on their own GPUs.
        pipeline = encoder_depth + llm.pp * llm_stage.total + (m - 1) * max(stage_s.values())
        busy = {llm.name: m * llm_stage + Seconds(dp_sync=dp_sync)}
        idle = pipeline - m * llm_stage.total
        return busy, idle, stage_s, memory
