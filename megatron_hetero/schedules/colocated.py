"""Colocated placement: every module spans all ranks, the encoders with pp=1.

LLM pp=1: microbatch by microbatch, encoder forward, boundary forward, LLM forward/backward, boundary
backward, encoder backward (one autograd graph through the boundary): encoder activations are held
for one microbatch at a time.

LLM pp>1 (the encoder's backward needs gradients that the LLM pipeline returns at its end), by
--hetero-colocated-schedule:
- recompute (default): the encoders run forward without a graph for every microbatch and only their
  boundary rows are kept; the LLM runs its 1F1B pipeline; then each microbatch's slot gradients go
  back across the boundary and the encoder recomputes that microbatch's forward and runs its
  backward. Encoder activation memory stays one microbatch's, for one extra encoder forward.
- three-phase, bubbles: each rank runs its encoder work and its LLM stage's in the order
  colocated_order.py gives (no recompute; the boundary's two sides posted apart, on groups of their
  own). Evaluation (forward only) runs as recompute does, without the recompute.
"""

import torch

from megatron_hetero.boundary import boundary_exchange
from megatron_hetero.boundary.exchange import exchange_gradients, split_recvs, split_sends
from megatron_hetero.runtime.step import ColocatedView, StepContext
from megatron_hetero.schedules.colocated_order import colocated_order
from megatron_hetero.schedules.pipeline import Link, run_stage
from megatron_hetero.schedules.stages import LLMStage


def colocated_step(ctx: StepContext) -> None:
    if ctx.run.llm.layout.pp > 1 and not ctx.forward_only and ctx.run.colocated_schedule != "recompute":
        _ordered_step(ctx)
        return
    if ctx.run.llm.layout.pp == 1:
        for i in range(ctx.num_microbatches):
            view = ColocatedView(ctx, i)
            with torch.set_grad_enabled(not ctx.forward_only):
                out = ctx.llm_forward_step(i, view)
            if not ctx.forward_only:
                if i == ctx.num_microbatches - 1:
                    ctx.last_backward(*ctx.run.modules.values())
                with ctx.timers("llm-backward", ctx.run.llm.name):
                    ctx.backward(view.inputs, out, [None])
        return

    encoders = ctx.run.encoders
    with torch.no_grad():
        media = {n: [boundary_exchange(ctx.run_encoder(m, i), ctx.plans[n][i])
                     for i in range(ctx.num_microbatches)] for n, m in encoders.items()}
    stage = LLMStage(ctx, media=media)
    run_stage(stage, ctx.num_microbatches, ctx.clock)
    del media
    if ctx.forward_only:
        return
    for name, module in encoders.items():
        if module.ddp is None:
            continue
        for i in range(ctx.num_microbatches):
            # Later LLM stages hold no slots: they only receive their encoder rows' gradients.
            grad_slots = stage.media_grads[name].pop(i, None)
            if grad_slots is None:
                grad_slots = ctx.adapter.boundary_like()
            rows = ctx.run_encoder(module, i)  # recomputed, with its graph
            with ctx.timers("boundary"):
                grad_rows = exchange_gradients(grad_slots, ctx.plans[name][i])
            if i == ctx.num_microbatches - 1:
                ctx.last_backward(module)
            with ctx.timers("encoder-backward", name):
                ctx.backward([None], [rows], [grad_rows])


class _SplitLLMStage(LLMStage):
    """The LLM stage of an ordered colocated step: on the first stage its microbatches' slots come
    from split_recvs (this rank's own rows copied in) and their gradients leave by split_sends (this
    rank's own kept for its encoder's backward)."""

    def __init__(self, ctx: StepContext):
        super().__init__(ctx)
        self.rows_group, self.grads_group = ctx.run.boundary_groups
        self.own_rows, self.own_grads = {}, {}  # (encoder, microbatch) -> this rank's side

    def recv_forward(self, i):
        if not self.first:
            return super().recv_forward(i)
        like = self.ctx.adapter.boundary_like()
        return [split_recvs(plans[i], "forward", like, self.own_rows.pop((name, i), None), self.rows_group)
                for name, plans in self.ctx.plans.items()]

    def send_backward(self, i, grads):
        if not self.first:
            return super().send_backward(i, grads)
        routed = [n for n in self.trainable if n in self.ctx.plans]
        self.own_grads.update({(n, i): g for n, g in zip(routed, grads)})
        return [split_sends(g, self.ctx.plans[n][i], "backward", self.grads_group) for n, g in zip(routed, grads)]


def _ordered_step(ctx: StepContext) -> None:
    run, llm = ctx.run, ctx.run.llm
    stage = _SplitLLMStage(ctx)
    order = colocated_order(run.colocated_schedule, llm.coords()["pp"], llm.layout.pp, ctx.num_microbatches,
                            list(run.encoders), stage.trainable)
    last_backward = {op.encoder: op for op in order if op.kind == "EB"}
    link = Link(ctx.clock)
    saved = {}  # (encoder, microbatch) -> its rows with their graph, until the encoder's backward
    for op in order:
        if op.kind == "EF":
            rows = ctx.run_encoder(run.encoders[op.encoder], op.i)
            if op.encoder in stage.trainable:
                saved[op.encoder, op.i] = rows
            if stage.first:
                stage.own_rows[op.encoder, op.i] = rows.detach()
            with ctx.timers("boundary"):
                link.exchange([split_sends(rows, ctx.plans[op.encoder][op.i], "forward", stage.rows_group)], [])
        elif op.kind == "EB":
            rows = saved.pop((op.encoder, op.i))
            own = stage.own_grads.pop((op.encoder, op.i), None)
            with ctx.timers("boundary"):
                (grad_rows,) = link.exchange(
                    [], [split_recvs(ctx.plans[op.encoder][op.i], "backward", rows, own, stage.grads_group)])
            if op == last_backward[op.encoder]:
                ctx.last_backward(run.encoders[op.encoder])
            with ctx.timers("encoder-backward", op.encoder):
                ctx.backward([None], [rows], [grad_rows])
        elif op.kind == "F":
            received = link.exchange([], stage.recv_forward(op.i))
            link.exchange(stage.send_forward(op.i, stage.forward(op.i, received)), [])
        else:
            received = link.exchange([], stage.recv_backward(op.i))
            link.exchange(stage.send_backward(op.i, stage.backward(op.i, received)), [])
    assert not saved and not stage.own_rows and not stage.own_grads, "every microbatch's work ran"
    link.finish()
