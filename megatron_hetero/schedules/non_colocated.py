"""Non-colocated placement: modules on disjoint ranks, one pipeline in which each encoder's stages
precede the LLM's. Every rank runs its one stage in 1F1B order (pipeline.py); the link between an
encoder's last stage and the LLM's first is the boundary, per microbatch (stages.ExchangedRows). A
frozen encoder runs all its forwards ahead and gets nothing back."""

from megatron_hetero.schedules.pipeline import run_stage
from megatron_hetero.schedules.stages import EncoderStage, ExchangedRows, LLMStage
from megatron_hetero.schedules.step import StepContext


def non_colocated_step(ctx: StepContext) -> None:
    if ctx.run.llm.held:
        stage = LLMStage(ctx, ExchangedRows(ctx))
    else:
        (module,) = [m for m in ctx.run.encoders.values() if m.held]
        stage = EncoderStage(ctx, module, forward_only=ctx.forward_only)
    run_stage(stage, ctx.num_microbatches, ctx.clock)
