"""The pipeline stages a rank runs: one stage of an encoder or one stage of the LLM (see pipeline.py
for the order they run in). Each keeps what its microbatches need between forward and backward and
runs them through the step context (the script's forward step, Megatron's forward/backward step).

Links between stages: inside a module, a stage talks to the stage before and after it at the same
(tp, cp, dp) coordinates; between an encoder's last stage and the LLM's first, the boundary plan of
the microbatch routes rows forward and gradients back (non-colocated), or the colocated schedule has
already moved the rows (`media` given) and collects their gradients.
"""

import torch

from megatron_hetero.boundary.exchange import backward_recvs, backward_sends, forward_recvs, forward_sends
from megatron_hetero.runtime.model import Media
from megatron_hetero.runtime.step import LLMView, StepContext
from megatron_hetero.schedules.pipeline import stage_recv, stage_send


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
    """This rank's stage of an encoder over the step's microbatches."""

    def __init__(self, ctx: StepContext, module, forward_only: bool = False):
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
            y = self.ctx.run_encoder(self.module, i, x)
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
        if i == self.ctx.num_microbatches - 1:  # 1F1B's last backward
            self.ctx.last_backward(self.module)
        with self.ctx.timers("encoder-backward", self.name):
            grads = self.ctx.backward([x], [y], [received[0]])
        return _grads(grads, [x])

    def send_backward(self, i, grads):
        return [] if self.first else [stage_send(grads[0], self.prev)]


class LLMStage:
    """This rank's LLM stage over the step's microbatches.

    On the first stage each microbatch's image/audio rows come either through the boundary
    (non-colocated: the step's plans) or ready-made (`media`: encoder name -> per-microbatch rows,
    colocated; their gradients are kept in `media_grads`). The last stage runs the script's loss
    function (Megatron's forward_step); forward-only keeps the step's losses without a graph.
    """

    def __init__(self, ctx: StepContext, media: dict | None = None):
        self.ctx, self.media = ctx, media
        self.module = module = ctx.run.llm
        self.first, self.last = module.first_stage, module.last_stage
        self.prev, self.next = _stage_neighbours(module)
        # Which encoders' rows need gradients: trainable ones (a frozen one gets nothing back).
        self.trainable = [n for n, m in ctx.run.encoders.items() if not m.layout.freeze]
        self.runs_backward = not ctx.forward_only
        self.stages_downstream = module.layout.pp - 1 - module.coords()["pp"]
        self.media_grads = {name: {} for name in self.trainable}
        self.saved = {}

    def _hidden_like(self, i):
        return self.ctx.adapter.stage_hidden_like(self.module, self.ctx.calls[i], self.ctx.share(self.module))

    def recv_forward(self, i):
        if not self.first:
            return [stage_recv(self._hidden_like(i), self.prev)]
        if self.media is not None:
            return []
        like = self.ctx.adapter.boundary_like()
        return [forward_recvs(plans[i], like) for plans in self.ctx.plans.values()]

    def forward(self, i, received):
        hidden, media = None, {}
        if self.first:
            slots = ({n: s[i] for n, s in self.media.items()} if self.media is not None
                     else dict(zip(self.ctx.plans, received)))
            for name, s in slots.items():
                s = s.detach().requires_grad_(self.runs_backward and name in self.trainable)
                media[name] = Media(s, self.ctx.plans[name][i])
            inputs = [media[n].rows for n in self.trainable if n in media]
        else:
            hidden = received[0].requires_grad_(self.runs_backward)
            inputs = [hidden]
        view = LLMView(self.ctx, media, hidden, inputs)
        with torch.set_grad_enabled(self.runs_backward):
            out = self.ctx.llm_forward_step(i, view)
        if self.runs_backward:
            self.saved[i] = (inputs, out)
        return [] if self.last else out

    def send_forward(self, i, outputs):
        return [] if self.last else [stage_send(outputs[0], self.next)]

    def recv_backward(self, i):
        return [] if self.last else [stage_recv(self._hidden_like(i), self.next)]

    def backward(self, i, received):
        inputs, out = self.saved.pop(i)
        if i == self.ctx.num_microbatches - 1:  # 1F1B's last backward
            self.ctx.last_backward(self.module)
        with self.ctx.timers("llm-backward", self.module.name):
            grads = _grads(self.ctx.backward(inputs, out, [None if self.last else received[0]]), inputs)
        if self.first and self.media is not None:  # colocated: the schedule routes them back itself
            for name, g in zip([n for n in self.trainable if n in self.media], grads):
                self.media_grads[name][i] = g
        return grads

    def send_backward(self, i, grads):
        if not self.first:
            return [stage_send(grads[0], self.prev)]
        if self.media is not None:
            return []
        routed = [n for n in self.trainable if n in self.ctx.plans]
        return [backward_sends(g, self.ctx.plans[n][i]) for n, g in zip(routed, grads)]
