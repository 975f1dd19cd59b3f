"""The pipeline stages a rank runs: one stage of an encoder or one stage of the LLM (see pipeline.py
for the order they run in). Each keeps what its microbatches need between forward and backward,
runs them through the step context, and returns its outputs and input gradients to the executor.

Links between stages: inside a module, a stage talks to the stage before and after it at the same
(tp, cp, dp) coordinates. The LLM's first stage takes each encoder's rows through its
`BoundaryRows`: the boundary plan's transfers (non-colocated: `ExchangedRows`), rows a colocated
schedule has already moved (`GivenRows`), or the two sides of an ordered colocated step
(colocated.py: `SplitRows`); the same object sends their gradients back.
"""

from typing import Protocol

import torch

from megatron_hetero.boundary.non_colocated import backward_recvs, backward_sends, forward_recvs, forward_sends
from megatron_hetero.boundary.transfer import Transfer
from megatron_hetero.parallel.context import ModuleRuntime
from megatron_hetero.runtime.model import Media
from megatron_hetero.schedules.pipeline import stage_recv, stage_send
from megatron_hetero.schedules.step import LLMView, StepContext


def _stage_neighbours(module):
    """Global ranks of the stage before and after this rank's stage of `module` (None at the ends)."""
    layout, coords = module.layout, module.coords()
    at = dict(tp=coords["tp"], cp=coords["cp"], dp=coords["dp"])
    prev = layout.rank_of(pp=coords["pp"] - 1, **at) if coords["pp"] > 0 else None
    nxt = layout.rank_of(pp=coords["pp"] + 1, **at) if coords["pp"] < layout.pp - 1 else None
    return prev, nxt


def _grads(grads: list, inputs: list) -> list:
    return [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, inputs) if x is not None]


class EncoderStage:
    """This rank's stage of an encoder over the step's microbatches; its last stage's rows leave
    through the boundary plan (non-colocated)."""

    def __init__(self, ctx: StepContext, module: ModuleRuntime, forward_only: bool = False):
        self.ctx, self.module = ctx, module
        self.name, layout = module.name, module.layout
        self.first, self.last = module.first_stage, module.last_stage
        self.prev, self.next = _stage_neighbours(module)
        self.plans = ctx.plans[self.name]
        self.runs_backward = not (module.ddp is None or forward_only)
        self.stages_downstream = layout.pp - 1 - module.coords()["pp"] + ctx.run.llm.layout.pp
        self.saved = {}  # microbatch -> (its input leaf or None, its output)

    def _hidden_like(self, i):
        call = self.ctx.calls[i]
        return self.ctx.adapter.stage_hidden_like(self.module, call, self.ctx.encoder_items(self.module, i))

    def recv_forward(self, i):
        return [] if self.first else [stage_recv(self._hidden_like(i), self.prev)]

    def forward(self, i, received):
        x = None if self.first else received[0].requires_grad_(self.runs_backward)
        with torch.set_grad_enabled(self.runs_backward):
            y = self.ctx.encoder_forward(self.module, i, x)
        if self.runs_backward:
            self.saved[i] = (x, y)
        return [y]

    def send_forward(self, i, outputs):
        if self.last:
            return [forward_sends(outputs[0], self.plans[i])]
        return [stage_send(outputs[0], self.next)]

    def recv_backward(self, i):
        if self.last:  # row gradients, shaped like the rows sent
            return [backward_recvs(self.plans[i], self.saved[i][1])]
        return [stage_recv(self._hidden_like(i), self.next)]

    def backward(self, i, received):
        x, y = self.saved.pop(i)
        with self.ctx.timers("encoder-backward", self.name):
            grads = self.ctx.backward([self.module], [x], [y], [received[0]])
        return _grads(grads, [x])

    def send_backward(self, i, grads):
        return [] if self.first else [stage_send(grads[0], self.prev)]


class BoundaryRows(Protocol):
    """How the LLM's first stage gets each encoder's rows of microbatch i (in ctx.plans order) and
    returns their gradients (trainable encoders, in their order)."""

    def recv(self, i: int) -> list[Transfer]: ...
    def rows(self, i: int, received: list) -> dict[str, torch.Tensor]: ...
    def send_grads(self, i: int, grads: dict[str, torch.Tensor]) -> list[Transfer]: ...


class ExchangedRows:
    """Non-colocated: rows arrive by the boundary plan's transfers, gradients leave by them."""

    def __init__(self, ctx: StepContext):
        self.ctx = ctx

    def recv(self, i):
        like = self.ctx.adapter.boundary_like()
        return [forward_recvs(plans[i], like) for plans in self.ctx.plans.values()]

    def rows(self, i, received):
        return dict(zip(self.ctx.plans, received))

    def send_grads(self, i, grads):
        return [backward_sends(g, self.ctx.plans[name][i]) for name, g in grads.items()]


class GivenRows:
    """Rows already moved (`media`: encoder name -> rows per microbatch); their gradients go back to
    the schedule as the stage's backward results (pipeline.StageResults)."""

    def __init__(self, media: dict[str, list]):
        self.media = media

    def recv(self, i):
        return []

    def rows(self, i, received):
        return {name: rows[i] for name, rows in self.media.items()}

    def send_grads(self, i, grads):
        return []


class LLMStage:
    """This rank's LLM stage over the step's microbatches.

    On the first stage each microbatch's image/audio rows come through `boundary`, and its backward
    returns their gradients (trainable encoders, `routed` order); later stages take and return the
    previous stage's hidden states. Every forward returns [the stage's output]: on the last stage
    Megatron's forward_step output (the loss, or a generation's logits). Forward-only keeps the
    step's losses without a graph.
    """

    def __init__(self, ctx: StepContext, boundary: BoundaryRows | None = None):
        self.ctx, self.boundary = ctx, boundary
        self.module = module = ctx.run.llm
        self.first, self.last = module.first_stage, module.last_stage
        self.prev, self.next = _stage_neighbours(module)
        # Which encoders' rows need gradients: trainable ones (a frozen one gets nothing back).
        self.routed = [n for n, m in ctx.run.encoders.items() if not m.layout.freeze]
        self.runs_backward = not ctx.forward_only
        self.stages_downstream = module.layout.pp - 1 - module.coords()["pp"]
        self.saved = {}

    def _hidden_like(self, i, stage: int | None = None):
        """Stage `stage`'s input (None: this one's); the next stage's is this one's output."""
        return self.ctx.adapter.stage_hidden_like(self.module, self.ctx.calls[i], self.ctx.share(self.module), stage)

    def recv_forward(self, i):
        if not self.first:
            return [stage_recv(self._hidden_like(i), self.prev)]
        return self.boundary.recv(i)

    def forward(self, i, received):
        hidden, media = None, {}
        if self.first:
            for name, rows in self.boundary.rows(i, received).items():
                rows = rows.detach().requires_grad_(self.runs_backward and name in self.routed)
                media[name] = Media(rows, self.ctx.plans[name][i])
            inputs = [media[n].rows for n in self.routed]
        else:
            hidden = received[0].requires_grad_(self.runs_backward)
            inputs = [hidden]
        with torch.set_grad_enabled(self.runs_backward):
            out = self.ctx.llm_forward_step(i, LLMView(self.ctx, media, hidden))
        if self.runs_backward:
            self.saved[i] = (inputs, out)
        return out

    def send_forward(self, i, outputs):
        return [] if self.last else [stage_send(outputs[0], self.next)]

    def recv_backward(self, i):
        return [] if self.last else [stage_recv(self._hidden_like(i, self.module.coords()["pp"] + 1), self.next)]

    def backward(self, i, received):
        inputs, out = self.saved.pop(i)
        with self.ctx.timers("llm-backward", self.module.name):
            grads = self.ctx.backward([self.module], inputs, out, [None if self.last else received[0]])
        return _grads(grads, inputs)

    def send_backward(self, i, grads):
        if not self.first:
            return [stage_send(grads[0], self.prev)]
        return self.boundary.send_grads(i, dict(zip(self.routed, grads)))
