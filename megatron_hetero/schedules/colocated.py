"""Colocated placement: every module spans all ranks, the encoders with pp=1 (but an encoder
stacked on the LLM's first pipeline stage, layout on_first_stage: Megatron's homogeneous layout under
LLM PP, which only that stage's ranks hold; a rank runs the encoders it holds, `encoders_here`).

LLM pp=1 (`_per_microbatch`): microbatch by microbatch, every encoder's forward and boundary
exchange, the LLM's forward step, then one backward through the LLM, the boundary and the encoders
(one autograd graph): encoder activations are held for one microbatch at a time. An encoder
batched over k microbatches (layout `microbatches`, `Batched`) runs its forward at the first of
each k and its backward after the last; in between each microbatch's rows enter the graph as a
leaf of their own, where that microbatch's backward leaves their gradient.

LLM pp>1 (the encoder's backward needs gradients that the LLM pipeline returns at its end), by
--hetero-colocated-schedule:
- recompute (default, `_recompute`): the encoders run forward without a graph for every
  microbatch and only their boundary rows are kept; the LLM runs its 1F1B pipeline; then each
  microbatch's row gradients go back across the boundary and the encoder recomputes that
  microbatch's forward and runs its backward. Encoder activation memory stays one microbatch's,
  for one extra encoder forward. An encoder batched over k microbatches runs both forwards and its
  backward once per k (activations of k microbatches).
- three-phase, bubbles (`_ordered`): each rank runs its encoder work and its LLM stage's in the
  order colocated_order.py gives (no recompute; the boundary's two sides posted apart, on groups of
  their own, each transfer at its producer's point of the order: pipeline.execute_keyed).
  Evaluation (forward only) runs as recompute does, without the recompute.
"""

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from megatron_hetero.boundary import boundary_exchange
from megatron_hetero.boundary.colocated import exchange_gradients, split_recvs, split_sends
from megatron_hetero.parallel.context import ModuleRuntime
from megatron_hetero.runtime.model import Media
from megatron_hetero.schedules.colocated_order import keyed_order, producer_keys
from megatron_hetero.schedules.pipeline import Op, OpKind, execute_keyed, run_stage
from megatron_hetero.schedules.stages import GivenRows, LLMStage
from megatron_hetero.schedules.step import LLMView, StepContext
from megatron_hetero.spec.layout import ColocatedSchedule


def colocated_step(ctx: StepContext) -> None:
    if ctx.run.llm.layout.pp == 1:
        _per_microbatch(ctx)
    elif ctx.forward_only or ctx.run.colocated_schedule == ColocatedSchedule.RECOMPUTE:
        _recompute(ctx)
    else:
        _ordered(ctx)


def encoders_to_llm(ctx: StepContext, i: int, given: dict | None = None) -> dict[str, Media]:
    """Every encoder's forward on microbatch i (its rows from `given` for the encoders named there)
    and the boundary exchange of its rows (autograd: the exchange's backward routes the row
    gradients back): encoder name -> the rows this LLM rank takes."""
    media, given = {}, given or {}
    for name, module in ctx.run.encoders_here.items():
        rows = given[name] if name in given else ctx.encoder_forward(module, i)
        plan = ctx.plans[name][i]
        with ctx.timers("boundary"):
            media[name] = Media(boundary_exchange(rows, plan, llm_tp_group=ctx.run.llm.pgs.tp), plan)
    return media


def group_forward(ctx: StepContext, module: ModuleRuntime, i: int) -> tuple[torch.Tensor, tuple]:
    """Encoder `module`'s forward on the microbatches of its pass starting at i (k of them, or
    those left in the step): (its rows, their parts per microbatch, in order)."""
    k = min(module.layout.microbatches, ctx.num_microbatches - i)
    rows = ctx.encoder_forward(module, i, k=k)
    return rows, rows.split([ctx.plans[module.name][j].num_source_rows for j in range(i, i + k)])


class Batched:
    """The encoders of a pp=1 step batched over several microbatches: each group's forward, its
    rows per microbatch as leaves (their gradients left there by each microbatch's backward), and
    the group's backward from them."""

    def __init__(self, ctx: StepContext):
        self.ctx = ctx
        self.modules = {n: m for n, m in ctx.run.encoders_here.items() if m.layout.microbatches > 1}
        self.rows, self.leaves = {}, {}  # encoder name -> the group's rows; their leaves per microbatch

    def rows_of(self, i: int) -> dict:
        """Encoder name -> its rows of microbatch i (the group's forward at its first)."""
        for name, module in self.modules.items():
            if i % module.layout.microbatches == 0:
                self.rows[name], parts = group_forward(self.ctx, module, i)
                self.leaves[name] = [p.detach().requires_grad_(p.requires_grad) for p in parts]
        return {name: leaves[i % self.modules[name].layout.microbatches] for name, leaves in self.leaves.items()}

    def backward(self, i: int) -> None:
        """After microbatch i's backward: the backward of every group it ends."""
        for name, module in self.modules.items():
            rows = self.rows[name]
            last = (i + 1) % module.layout.microbatches == 0 or i + 1 == self.ctx.num_microbatches
            if not last or not rows.requires_grad:
                continue
            grads = [torch.zeros_like(x) if x.grad is None else x.grad for x in self.leaves.pop(name)]
            with self.ctx.timers("encoder-backward", name):
                self.ctx.backward([module], [None], [self.rows.pop(name)], [torch.cat(grads)])


def _per_microbatch(ctx: StepContext) -> None:
    """LLM pp=1: encoders, boundary, LLM forward; one backward through all of them (but the
    batched encoders: theirs once per group)."""
    batched = Batched(ctx)
    together = [m for name, m in ctx.run.modules.items() if name not in batched.modules]
    for i in range(ctx.num_microbatches):
        with torch.set_grad_enabled(not ctx.forward_only):
            out = ctx.llm_forward_step(i, LLMView(ctx, encoders_to_llm(ctx, i, batched.rows_of(i))))
        if not ctx.forward_only:
            with ctx.timers("llm-backward", ctx.run.llm.name):
                ctx.backward(together, [], out, [None])
            batched.backward(i)


def _recompute(ctx: StepContext) -> None:
    """LLM pp>1: encoder rows without a graph, the LLM pipeline, each encoder pass again."""
    encoders, M, tp = ctx.run.encoders_here, ctx.num_microbatches, ctx.run.llm.pgs.tp
    with torch.no_grad():
        media = {n: [boundary_exchange(rows, ctx.plans[n][i], llm_tp_group=tp)
                     for i, rows in enumerate(_all_rows(ctx, m))] for n, m in encoders.items()}
    stage = LLMStage(ctx, GivenRows(media))
    results = run_stage(stage, M, ctx.clock)
    del media
    if ctx.forward_only:
        return
    for name, module in encoders.items():
        if module.ddp is None:
            continue
        for i in range(0, M, module.layout.microbatches):
            rows, parts = group_forward(ctx, module, i)  # recomputed, with its graph
            grad_rows = []
            for j in range(i, i + len(parts)):
                # The first stage's backward returned the rows' gradients; later stages hold no rows.
                grads = dict(zip(stage.routed, results.backward[j])) if stage.first else {}
                with ctx.timers("boundary"):
                    grad_rows.append(exchange_gradients(grads.get(name, ctx.adapter.boundary_like()),
                                                        ctx.plans[name][j]))
            with ctx.timers("encoder-backward", name):
                ctx.backward([module], [None], [rows], [torch.cat(grad_rows)])


def _all_rows(ctx: StepContext, module: ModuleRuntime) -> list:
    """Encoder `module`'s rows of every microbatch, one forward per pass."""
    step = module.layout.microbatches
    return [part for i in range(0, ctx.num_microbatches, step) for part in group_forward(ctx, module, i)[1]]


@dataclass
class OwnRows:
    """What this rank hands itself between its encoder ops and its first LLM stage in an ordered
    step: its encoders' rows its own LLM rank takes, and their gradients back ((encoder, i) -> rows)."""

    rows: dict = field(default_factory=dict)
    grads: dict = field(default_factory=dict)


class SplitRows:
    """The LLM's first stage in an ordered step: rows arrive by split_recvs (this rank's own copied
    in) on the rows' group, gradients leave by split_sends (this rank's own kept) on theirs."""

    def __init__(self, ctx: StepContext, own: OwnRows):
        self.ctx, self.own = ctx, own
        self.rows_group, self.grads_group = ctx.run.boundary_groups

    def recv(self, i):
        return [self.recv_one(i, name) for name in self.ctx.plans]

    def recv_one(self, i, name):
        """Encoder `name`'s rows of microbatch i (after this rank's own forward of it, if it runs one)."""
        own = self.own.rows.pop((name, i), None)
        return split_recvs(self.ctx.plans[name][i], "forward", self.ctx.adapter.boundary_like(), own, self.rows_group)

    def rows(self, i, received):
        return dict(zip(self.ctx.plans, received))

    def send_grads(self, i, grads):
        self.own.grads.update({(name, i): g for name, g in grads.items()})
        return [split_sends(g, self.ctx.plans[name][i], "backward", self.grads_group) for name, g in grads.items()]


def _ordered(ctx: StepContext) -> None:
    """LLM pp>1, three-phase or bubbles: the rank's ops in colocated_order's order, one executor."""
    run, llm = ctx.run, ctx.run.llm
    own = OwnRows()
    rows = SplitRows(ctx, own)
    stage = LLMStage(ctx, rows)
    rows_group, grads_group = run.boundary_groups
    here, encoders = run.encoders_here, list(run.encoders)
    assert list(ctx.plans) == encoders, (list(ctx.plans), encoders)  # producer_keys' order
    schedule, at, pp, M = run.colocated_schedule, llm.coords()["pp"], llm.layout.pp, ctx.num_microbatches
    order = keyed_order(schedule, at, pp, M, encoders, stage.routed, here=list(here))
    saved = {}  # (encoder, microbatch) -> its rows with their graph, until the encoder's backward

    def receive(op: Op, j: int):  # the j-th of producer_keys(op)
        if op.kind == OpKind.EB:
            key = (op.encoder, op.i)
            return split_recvs(ctx.plans[op.encoder][op.i], "backward", saved[key], own.grads.pop(key, None),
                               grads_group)
        if op.kind == OpKind.F:
            return rows.recv_one(op.i, encoders[j]) if stage.first else stage.recv_forward(op.i)[j]
        return stage.recv_backward(op.i)[j]

    def compute(op: Op, received: list) -> list:
        if op.kind == OpKind.EF:
            rows = ctx.encoder_forward(run.encoders[op.encoder], op.i)
            if op.encoder in stage.routed:
                saved[op.encoder, op.i] = rows
            if stage.first:
                own.rows[op.encoder, op.i] = rows.detach()
            return [split_sends(rows, ctx.plans[op.encoder][op.i], "forward", rows_group)]
        if op.kind == OpKind.EB:
            with ctx.timers("encoder-backward", op.encoder):
                ctx.backward([run.encoders[op.encoder]], [None], [saved.pop((op.encoder, op.i))], received)
            return []
        if op.kind == OpKind.F:
            return stage.send_forward(op.i, stage.forward(op.i, received))
        return stage.send_backward(op.i, stage.backward(op.i, received))

    def phase(op: Op):  # the boundary's transfers are the encoder ops'
        return ctx.timers("boundary") if op.kind in (OpKind.EF, OpKind.EB) else nullcontext()

    execute_keyed(order, lambda op: producer_keys(schedule, at, pp, M, encoders, op), receive, compute, ctx.clock,
                  phase=phase)
    assert not saved and not own.rows and not own.grads, "every microbatch's work ran"
