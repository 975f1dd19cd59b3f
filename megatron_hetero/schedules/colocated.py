"""Colocated, LLM PP=1: encoder forward on the whole global batch (each encoder DP rank its slice),
boundary forward, LLM forward/backward per microbatch (gradients accumulate on the boundary output),
boundary backward, encoder backward."""

import torch

from megatron_hetero.boundary import boundary_exchange


def colocated_step(trainer, batch) -> float:
    plan = trainer.plan(batch)
    slots = boundary_exchange(trainer.encode(batch), plan)
    # The LLM's microbatches backpropagate into this leaf; the boundary and encoder backward once.
    leaf = slots.detach().requires_grad_(slots.requires_grad)
    loss_sum = trainer.llm_forward_backward(batch, leaf, plan, batch.num_loss_tokens)
    if slots.requires_grad:
        slots.backward(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
    return trainer.finish_step(loss_sum, batch.num_loss_tokens)
