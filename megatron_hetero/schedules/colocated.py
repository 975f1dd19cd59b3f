"""Colocated placement: every module spans all ranks, the encoders with pp=1.

LLM pp=1: microbatch by microbatch, encoder forward, boundary forward, LLM forward/backward, boundary
backward, encoder backward: encoder activations are held for one microbatch at a time.

LLM pp>1 (the encoder's backward needs gradients that the LLM pipeline returns at its end): the
encoders run forward without a graph for every microbatch and only their boundary rows are kept; the
LLM runs its 1F1B pipeline; then each microbatch's slot gradients go back across the boundary and the
encoder recomputes that microbatch's forward and runs its backward. Encoder activation memory stays
one microbatch's, for one extra encoder forward.
"""

import torch

from megatron_hetero.boundary import boundary_exchange
from megatron_hetero.boundary.exchange import exchange_gradients
from megatron_hetero.schedules.pipeline import run_stage
from megatron_hetero.schedules.stages import LLMStage


def colocated_step(trainer, batch) -> float:
    micro = trainer.microbatches(batch)
    names = list(trainer.encoders)
    plans = {n: [trainer.plan(n, mb) for mb in micro] for n in names}
    trainable = [n for n in names if not trainer.layout_encoders[n].freeze]

    def slots(name, i):
        rows = trainer.encoder_forward(name, micro[i])
        with trainer.timers("boundary"):
            return boundary_exchange(rows, plans[name][i])

    if trainer.layout.llm.pp == 1:
        media = {n: {} for n in names}
        stage = LLMStage(trainer, micro, batch.num_loss_tokens, media=media)
        for i in range(len(micro)):
            for n in names:
                media[n][i] = slots(n, i)
            stage.forward(i, [])
            stage.backward(i, [])
            for n in names:
                routed = media[n].pop(i)
                if n in trainable:  # boundary backward, then the encoder's
                    with trainer.timers("encoder-backward"):
                        routed.backward(stage.media_grads[n].pop(i))
    else:
        with torch.no_grad():
            media = {n: [slots(n, i) for i in range(len(micro))] for n in names}
        stage = LLMStage(trainer, micro, batch.num_loss_tokens, media=media)
        run_stage(stage, len(micro), trainer.clock)
        del media
        for n in trainable:
            for i in range(len(micro)):
                # Later LLM stages hold no slots: they only receive their encoder rows' gradients.
                grad_slots = stage.media_grads[n].pop(i, None)
                if grad_slots is None:
                    grad_slots = trainer.boundary_like()
                rows = trainer.encoder_forward(n, micro[i])  # recomputed, with its graph
                with trainer.timers("boundary"):
                    grad_rows = exchange_gradients(grad_slots, plans[n][i])
                with trainer.timers("encoder-backward"):
                    rows.backward(grad_rows)
    return trainer.finish_step(stage.loss_sum, batch.num_loss_tokens)
