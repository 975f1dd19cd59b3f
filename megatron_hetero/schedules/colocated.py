"""Colocated placement: every module spans all ranks, the encoders with pp=1.

LLM pp=1: microbatch by microbatch, encoder forward, boundary forward, LLM forward/backward, boundary
backward, encoder backward (one autograd graph through the boundary): encoder activations are held
for one microbatch at a time.

LLM pp>1 (the encoder's backward needs gradients that the LLM pipeline returns at its end): the
encoders run forward without a graph for every microbatch and only their boundary rows are kept; the
LLM runs its 1F1B pipeline; then each microbatch's slot gradients go back across the boundary and the
encoder recomputes that microbatch's forward and runs its backward. Encoder activation memory stays
one microbatch's, for one extra encoder forward.
"""

import torch

from megatron_hetero.boundary import boundary_exchange
from megatron_hetero.boundary.exchange import exchange_gradients
from megatron_hetero.runtime.step import ColocatedView, StepContext
from megatron_hetero.schedules.pipeline import run_stage
from megatron_hetero.schedules.stages import LLMStage


def colocated_step(ctx: StepContext) -> None:
    if ctx.run.llm.layout.pp == 1:
        for i in range(ctx.num_microbatches):
            view = ColocatedView(ctx, i)
            with torch.set_grad_enabled(not ctx.forward_only):
                out = ctx.llm_forward_step(i, view)
            if not ctx.forward_only:
                if i == ctx.num_microbatches - 1:
                    ctx.last_backward(*ctx.run.modules.values())
                with ctx.timers("llm-backward"):
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
            with ctx.timers("encoder-backward"):
                ctx.backward([None], [rows], [grad_rows])
