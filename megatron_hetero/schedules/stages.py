"""The pipeline stages a rank runs: one stage of an encoder or one stage of the LLM (see pipeline.py
for the order they run in). Each keeps what its microbatches need between forward and backward.

Links between stages: inside a module, a stage talks to the stage before and after it at the same
(tp, cp, dp) coordinates; between an encoder's last stage and the LLM's first, the boundary plan of
the microbatch routes rows forward and gradients back (non-colocated), or the colocated schedule has
already moved the rows (`media` given) and collects their gradients.
"""

import torch

from megatron_hetero.boundary.exchange import backward_recvs, backward_sends, forward_recvs, forward_sends
from megatron_hetero.schedules.pipeline import stage_recv, stage_send


def _stage_neighbours(module):
    """Global ranks of the stage before and after this rank's stage of `module` (None at the ends)."""
    layout, coords = module.layout, module.coords()
    at = dict(tp=coords["tp"], cp=coords["cp"], dp=coords["dp"])
    prev = layout.rank_of(pp=coords["pp"] - 1, **at) if coords["pp"] > 0 else None
    nxt = layout.rank_of(pp=coords["pp"] + 1, **at) if coords["pp"] < layout.pp - 1 else None
    return prev, nxt


def _backward(output: torch.Tensor, grad: torch.Tensor | None, inputs: list[torch.Tensor]) -> list:
    """Backpropagate `output` (with `grad`, or a scalar loss) and return the inputs' gradients."""
    if output.requires_grad:
        torch.autograd.backward(output, None if grad is None else grad.to(output.dtype))
    return [x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs]


class EncoderStage:
    """This rank's stage of encoder `name` over the step's microbatches."""

    def __init__(self, trainer, name: str, micro: list, plans: list, forward_only: bool = False):
        self.trainer, self.name, self.micro, self.plans = trainer, name, micro, plans
        self.module = trainer.encoders[name]
        layout, coords = self.module.layout, self.module.coords()
        self.first, self.last = coords["pp"] == 0, coords["pp"] == layout.pp - 1
        self.prev, self.next = _stage_neighbours(self.module)
        self.runs_backward = not (layout.freeze or forward_only)
        self.stages_downstream = layout.pp - 1 - coords["pp"] + trainer.layout.llm.pp
        self.saved = {}  # microbatch -> (its input leaf or None, its output)

    def _hidden_like(self, i):
        return self.trainer.encoder_hidden_like(self.name, self.micro[i])

    def recv_forward(self, i):
        return [] if self.first else [stage_recv(self._hidden_like(i), self.prev)]

    def forward(self, i, received):
        x = None if self.first else received[0].requires_grad_(self.runs_backward)
        y = self.trainer.encoder_forward(self.name, self.micro[i], x)
        if self.runs_backward:
            self.saved[i] = (x, y)
        return [y]

    def send_forward(self, i, outputs):
        if self.last:
            return [forward_sends(outputs[0], self.plans[i])]
        return [stage_send(outputs[0].to(self.trainer.pipeline_dtype), self.next)]

    def recv_backward(self, i):
        if self.last:  # row gradients, shaped like the rows sent
            return [backward_recvs(self.plans[i], self.saved[i][1])]
        return [stage_recv(self._hidden_like(i), self.next)]

    def backward(self, i, received):
        x, y = self.saved.pop(i)
        with self.trainer.timers("encoder-backward"):
            return _backward(y, received[0], [] if x is None else [x])

    def send_backward(self, i, grads):
        return [] if self.first else [stage_send(grads[0], self.prev)]


class LLMStage:
    """This rank's LLM stage over the step's microbatches.

    On the first stage each microbatch's image/audio slots come either through the boundary
    (`plans`: encoder name -> per-microbatch plans, non-colocated) or ready-made (`media`: encoder
    name -> per-microbatch slots, colocated; their gradients are kept in `media_grads`). The last
    stage sums token losses into `loss_sum` and backpropagates loss / `num_loss_tokens`; with
    `num_loss_tokens` None it runs forward only and keeps each microbatch's logits in `logits`.
    """

    def __init__(self, trainer, micro: list, num_loss_tokens: int | None, plans=None, media=None):
        self.trainer, self.micro, self.num_loss_tokens = trainer, micro, num_loss_tokens
        self.plans, self.media = plans or {}, media or {}
        self.module = trainer.llm
        layout, coords = self.module.layout, self.module.coords()
        self.first, self.last = coords["pp"] == 0, coords["pp"] == layout.pp - 1
        self.prev, self.next = _stage_neighbours(self.module)
        # Which encoders' rows need gradients: trainable ones (a frozen one gets nothing back).
        self.trainable = [n for n, m in trainer.layout_encoders.items() if not m.freeze]
        self.runs_backward = num_loss_tokens is not None
        self.stages_downstream = layout.pp - 1 - coords["pp"]
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=trainer.device)
        self.media_grads = {name: {} for name in self.trainable}
        self.logits = {}
        self.saved = {}

    def recv_forward(self, i):
        if not self.first:
            return [stage_recv(self.trainer.llm_hidden_like(self.micro[i]), self.prev)]
        like = self.trainer.boundary_like()
        return [forward_recvs(plans[i], like) for plans in self.plans.values()]

    def forward(self, i, received):
        mb, trainer = self.micro[i], self.trainer
        hidden, media = None, {}
        if self.first:
            slots = dict(zip(self.plans, received)) if self.plans else {n: s[i] for n, s in self.media.items()}
            for name, s in slots.items():
                media[name] = s.detach().requires_grad_(self.runs_backward and name in self.trainable)
            inputs = [media[n] for n in self.trainable if n in media]
        else:
            hidden = received[0].requires_grad_(self.runs_backward)
            inputs = [hidden]
        with torch.set_grad_enabled(self.runs_backward):
            out = trainer.llm_stage_forward(mb, media, hidden, with_loss=self.runs_backward)
        if self.last and self.runs_backward:
            self.loss_sum += out.detach().double()
            out = out / self.num_loss_tokens
        elif self.last:
            self.logits[i] = out
        if self.runs_backward:
            self.saved[i] = (inputs, out)
        return [] if self.last else [out]

    def send_forward(self, i, outputs):
        return [] if self.last else [stage_send(outputs[0].to(self.trainer.pipeline_dtype), self.next)]

    def recv_backward(self, i):
        return [] if self.last else [stage_recv(self.trainer.llm_hidden_like(self.micro[i]), self.next)]

    def backward(self, i, received):
        inputs, out = self.saved.pop(i)
        with self.trainer.timers("llm-backward"):
            grads = _backward(out, None if self.last else received[0], inputs)
        if self.first and not self.plans:  # colocated: the schedule routes them back itself
            for name, g in zip([n for n in self.trainable if n in self.media], grads):
                self.media_grads[name][i] = g
        return grads

    def send_backward(self, i, grads):
        if not self.first:
            return [stage_send(grads[0], self.prev)]
        routed = [n for n in self.trainable if n in self.plans]
        return [backward_sends(g, self.plans[n][i]) for n, g in zip(routed, grads)]
