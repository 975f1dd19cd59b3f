"""Caption accuracy after training: greedy captions of held-out images through the trained modules,
in either placement and any layout (the encoders run once, then the LLM stage runs forward-only once
per generated position; the last stage's greedy tokens go back to every stage)."""

import torch
import torch.distributed as dist

from megatron_hetero.boundary.non_colocated import forward_recvs
from megatron_hetero.boundary.transfer import post
from megatron_hetero.data.megatron_data import samples_dict
from megatron_hetero.data.shapes import ShapesDataset, caption_accuracy
from megatron_hetero.data.tokenizer import CaptionTokenizer
from megatron_hetero.models.context_parallel import cp_positions
from megatron_hetero.models.kinds import encoder_kind
from megatron_hetero.runtime.model import HeteroModel
from megatron_hetero.schedules.colocated import encoders_to_llm
from megatron_hetero.schedules.forward_backward import step_context
from megatron_hetero.schedules.pipeline import run_stage
from megatron_hetero.schedules.stages import EncoderStage, GivenRows, LLMStage
from megatron_hetero.schedules.step import StepContext
from megatron_hetero.spec.layout import Placement


def logits_step(data_iterator, model):
    """The forward step of generation: the model's output, no labels and no loss function (logits on
    the last stage)."""
    output, _ = model(**{k: v for k, v in next(data_iterator).items() if k != "labels"})
    return output, None


def route_media(ctx: StepContext) -> dict:
    """Every encoder's rows on the LLM's first-stage ranks (encoder name -> [rows]), forward only."""
    run = ctx.run
    if run.layout.placement == Placement.COLOCATED:
        return {n: [media.rows] for n, media in encoders_to_llm(ctx, 0).items()}
    for module in run.encoders.values():
        if module.held:
            run_stage(EncoderStage(ctx, module, forward_only=True), 1, ctx.clock)
    if not run.llm.first_stage:
        return {}
    transfers = [forward_recvs(ctx.plans[n][0], ctx.adapter.boundary_like()) for n in run.encoders]
    ctx.clock.wait(post(transfers))
    return {n: [t.result()] for n, t in zip(run.encoders, transfers)}


def _next_tokens(run, logits, vocab: int, b_local: int, seq: int, device) -> torch.Tensor:
    """Greedy tokens [b_local, S] at every position, on every rank of this LLM replica: the last
    stage's argmax over its CP positions, gathered over CP, sent to every stage."""
    llm = run.llm
    layout, coords, pgs = llm.layout, llm.coords(), llm.pgs
    tokens = torch.zeros(b_local, seq, dtype=torch.long, device=device)
    if llm.last_stage:
        local = logits[..., :vocab].argmax(-1)
        gathered = [torch.empty_like(local) for _ in range(layout.cp)]
        dist.all_gather(gathered, local, group=pgs.cp)
        for cp_rank, part in enumerate(gathered):
            tokens[:, cp_positions(seq, layout.cp, cp_rank).to(device)] = part
    if layout.pp > 1:
        last = layout.rank_of(tp=coords["tp"], cp=coords["cp"], dp=coords["dp"], pp=layout.pp - 1)
        dist.broadcast(tokens, last, group=pgs.pp)
    return tokens


@torch.no_grad()
def generate_captions(model: HeteroModel, sizes, data: ShapesDataset, indices: list[int]) -> list[str]:
    """Greedy captions of data[indices], in index order (on every rank)."""
    run, tokenizer = model.run, CaptionTokenizer()
    kinds = [encoder_kind(m) for m in run.layout.encoders]
    item = samples_dict(data, indices, sizes, kinds, tokenizer, with_captions=False)
    ctx = step_context(model, logits_step, [item], forward_only=True)
    media = route_media(ctx)
    mine = []
    llm = run.llm
    if llm.held:
        share = llm.layout.dp_samples(len(indices), llm.coords()["dp"])
        prompt = 1 + sum(k.tokens_per_item(sizes) for k in kinds)
        device = next(llm.part.parameters()).device
        for t in range(prompt, sizes.seq_length):
            results = run_stage(LLMStage(ctx, GivenRows(media)), 1, ctx.clock)
            logits = results.forward[0][0] if llm.last_stage else None
            tokens = _next_tokens(run, logits, tokenizer.vocab_size, share.stop - share.start,
                                  sizes.seq_length, device)
            item["input_ids"][share, t] = tokens[:, t - 1].cpu()
        coords = llm.coords()
        if coords["tp"] == coords["cp"] == coords["pp"] == 0:
            mine = [(share.start + i, tokenizer.decode(row.tolist()))
                    for i, row in enumerate(item["input_ids"][share])]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [caption for _, caption in sorted(sum(gathered, []))]


def evaluate_captions(model: HeteroModel, sizes, data: ShapesDataset, num_samples: int) -> float:
    indices = list(range(num_samples))
    return caption_accuracy(generate_captions(model, sizes, data, indices), [data[i] for i in indices])


def report_waiting(model: HeteroModel) -> str:
    """Per rank, the share of the training steps' forward-backward time it spent blocked on other
    ranks' data (pipeline bubble, transfers), for rank 0 to print. Collective."""
    run, clock = model.run, model.clock
    held = [m for m in run.modules.values() if m.held]
    stage = "+".join(m.name for m in held) + f" pp{held[-1].coords()['pp']}"
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, (run.rank, stage, clock.waiting_s / max(clock.step_s, 1e-9)))
    return " waiting share of forward-backward time (pipeline bubble + transfers): " + " | ".join(
        f"rank {r} {name}: {100 * share:.1f}%" for r, name, share in shares)
