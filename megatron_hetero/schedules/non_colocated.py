"""Non-colocated placement: modules on disjoint ranks, one pipeline in which each encoder's stages
precede the LLM's. Every rank runs its one stage in 1F1B order (pipeline.py); the link between an
encoder's last stage and the LLM's first is the boundary, per microbatch. A frozen encoder runs all
its forwards ahead and gets nothing back."""

from megatron_hetero.schedules.pipeline import run_stage
from megatron_hetero.schedules.stages import EncoderStage, LLMStage


def non_colocated_step(trainer, batch) -> float:
    micro = trainer.microbatches(batch)
    plans = {n: [trainer.plan(n, mb) for mb in micro] for n in trainer.encoders}
    if trainer.llm.coords() is not None:
        stage = LLMStage(trainer, micro, batch.num_loss_tokens, plans=plans)
    else:
        (name,) = [n for n, m in trainer.encoders.items() if m.coords() is not None]
        stage = EncoderStage(trainer, name, micro, plans[name])
    run_stage(stage, len(micro), trainer.clock)
    loss_sum = getattr(stage, "loss_sum", None)
    return trainer.finish_step(loss_sum, batch.num_loss_tokens)
