"""Non-colocated, encoder PP=1 and LLM PP=1: a two-stage pipeline over disjoint ranks.

Microbatch i is the i-th microbatch of every LLM DP rank (the global batch's fixed split), split
again over the encoder's DP ranks. Encoder ranks run every microbatch's forward and send its rows
without waiting; LLM ranks post every receive, then run forward/backward as rows arrive and send each
microbatch's slot gradients back; encoder ranks backpropagate them as they arrive (GPipe order: the
encoder's forward runs ahead while the LLM computes). A frozen encoder gets nothing back.
"""

import torch

from megatron_hetero.boundary.exchange import recv_backward, recv_forward, send_backward, send_forward


def microbatches(batch, llm_dp: int, micro_batch_size: int) -> list:
    """Microbatch i: samples d*B/dp + i*M + j for every LLM DP rank d and j < M, in (d, j) order,
    so that LLM DP rank d holds slice d of it."""
    per_rank = len(batch.indices) // llm_dp
    return [batch.select([d * per_rank + i + j for d in range(llm_dp) for j in range(micro_batch_size)])
            for i in range(0, per_rank, micro_batch_size)]


def non_colocated_step(trainer, batch) -> float:
    micro = microbatches(batch, trainer.layout.llm.dp, trainer.args.micro_batch_size)
    plans = [trainer.plan(mb) for mb in micro]
    trainable = not trainer.encoder_layout.freeze  # known on every rank, unlike the module itself
    loss_sum = torch.zeros((), dtype=torch.float64, device=trainer.device)
    if trainer.encoder.coords() is not None:
        rows = [trainer.encode(mb) for mb in micro]
        sent = [send_forward(r, plan) for r, plan in zip(rows, plans)]
        for s in sent:
            s.wait()
        if trainable:
            for r, plan in zip(rows, plans):
                r.backward(recv_backward(plan, r).wait())
    if trainer.llm.coords() is not None:
        like = torch.empty(0, trainer.sizes.hidden_size, device=trainer.device, dtype=trainer.boundary_dtype)
        pending = [recv_forward(plan, like) for plan in plans]
        returned = []
        for mb, plan, p in zip(micro, plans, pending):
            slots = p.wait().requires_grad_(trainable)
            loss_sum += trainer.llm_forward_backward(mb, slots, plan, batch.num_loss_tokens)
            if trainable:
                returned.append(send_backward(slots.grad, plan))
        for r in returned:
            r.wait()
    return trainer.finish_step(loss_sum, batch.num_loss_tokens)
