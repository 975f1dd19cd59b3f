"""Rows across the boundary without a backward (evaluation), for either placement."""

from megatron_hetero.boundary import boundary_exchange
from megatron_hetero.boundary.exchange import forward_recvs, post
from megatron_hetero.schedules.pipeline import run_stage
from megatron_hetero.schedules.stages import EncoderStage


def route_media(trainer, batch) -> dict:
    """Every encoder's slots for `batch` on the LLM's first-stage ranks (encoder name -> slots);
    run every encoder stage this rank holds, forward only. Empty off the LLM's first stage (or
    [0, h] slots there, colocated)."""
    plans = {n: trainer.plan(n, batch) for n in trainer.encoders}
    if trainer.layout.placement == "colocated":
        return {n: boundary_exchange(trainer.encoder_forward(n, batch), p) for n, p in plans.items()}
    for name, module in trainer.encoders.items():
        if module.coords() is not None:
            run_stage(EncoderStage(trainer, name, [batch], [plans[name]], forward_only=True), 1, trainer.clock)
    coords = trainer.llm.coords()
    if coords is None or coords["pp"] != 0:
        return {}
    transfers = [forward_recvs(p, trainer.boundary_like()) for p in plans.values()]
    trainer.clock.wait(post(transfers))
    return {n: t.result() for n, t in zip(plans, transfers)}
