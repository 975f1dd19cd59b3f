"""One pipeline stage's forward/backward over the microbatches of a step, in 1F1B order.

The order is Megatron's non-interleaved 1F1B (`forward_backward_pipelining_without_interleaving`):
a stage with k stages downstream of it runs min(k, M) forwards (warm-up), then alternates one
forward and one backward (steady state), then drains the backwards (cool-down). Its communication
calls pair up with its neighbours' the same way (send forward + receive backward in one batch, send
backward + receive forward in the next), which is what keeps NCCL's in-order point-to-point streams
from deadlocking. A stage without backward (a frozen module) runs every forward ahead.

The stage decides what a microbatch's forward and backward are and which transfers feed them (a
boundary plan, a neighbouring stage of its module, or nothing); this file only orders them and
measures how long the stage waits for data.
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_hetero.boundary.exchange import Transfer, post


def warmup_microbatches(stages_downstream: int, num_microbatches: int) -> int:
    """Forwards a stage runs before its first backward."""
    return min(stages_downstream, num_microbatches)


def one_f_one_b(stages_downstream: int, num_microbatches: int, backward: bool = True) -> list[tuple[str, int]]:
    """The stage's compute order: ("F", i) / ("B", i), i the microbatch."""
    if not backward:
        return [("F", i) for i in range(num_microbatches)]
    warmup = warmup_microbatches(stages_downstream, num_microbatches)
    order = [("F", i) for i in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(num_microbatches - warmup, num_microbatches)]


def stage_send(tensor: torch.Tensor, peer: int) -> Transfer:
    """A tensor for the neighbouring stage `peer` (a global rank); nothing for an empty one (an
    encoder DP rank without items in a microbatch: both stages know it from the metadata)."""
    return Transfer([dist.P2POp(dist.isend, tensor.contiguous(), peer)] if tensor.numel() else [])


def stage_recv(like: torch.Tensor, peer: int) -> Transfer:
    """A tensor shaped and typed like `like` from the neighbouring stage `peer`."""
    buffer = torch.empty_like(like)
    return Transfer([dist.P2POp(dist.irecv, buffer, peer)] if buffer.numel() else [], dest=buffer)


class Stage(Protocol):
    """What one rank runs for one module stage. Transfers are built, not posted: the schedule
    batches them. `received` lists the results of the corresponding recv transfers."""

    runs_backward: bool
    stages_downstream: int

    def recv_forward(self, i: int) -> list[Transfer]: ...
    def forward(self, i: int, received: list) -> list[torch.Tensor]: ...
    def send_forward(self, i: int, outputs: list[torch.Tensor]) -> list[Transfer]: ...
    def recv_backward(self, i: int) -> list[Transfer]: ...
    def backward(self, i: int, received: list) -> list[torch.Tensor]: ...
    def send_backward(self, i: int, grads: list[torch.Tensor]) -> list[Transfer]: ...


@dataclass
class Clock:
    """Time this rank spends blocked on data from other ranks (on GPUs, after draining its own
    queued compute, so that its compute is not counted as waiting)."""

    device: torch.device
    waiting_s: float = 0.0
    step_s: float = 0.0  # training steps' forward-backward time, the waiting share's denominator

    def _sync(self):
        # The compute stream only: a device-wide synchronize would also wait for the posted
        # receives (NCCL runs them on its own streams) before the clock starts, hiding the wait.
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    @contextmanager
    def blocked(self):
        """Counts the time inside as waiting (a blocking receive, or waits on posted ones)."""
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.waiting_s += time.perf_counter() - start

    def wait(self, works) -> None:
        if not works:
            return
        with self.blocked():
            for work in works:
                work.wait()


@dataclass
class Link:
    """Posted transfers: receives are waited on when their results are needed; sends only at the
    end of the step, so that a stage never blocks on a neighbour that is not ready to receive."""

    clock: Clock
    unfinished_sends: list = field(default_factory=list)

    def exchange(self, sends: list[Transfer], recvs: list[Transfer]) -> list:
        works = post(sends + recvs)
        send_ops = sum(len(t.ops) for t in sends)
        if len(works) == send_ops + sum(len(t.ops) for t in recvs):
            self.unfinished_sends += works[:send_ops]
            self.clock.wait(works[send_ops:])
        else:  # one work for the whole batch (NCCL coalesces): wait on all of it
            self.clock.wait(works)
        return [t.result() for t in recvs]

    def finish(self):
        self.clock.wait(self.unfinished_sends)
        self.unfinished_sends.clear()


def run_stage(stage: Stage, num_microbatches: int, clock: Clock) -> None:
    """Run the stage's forwards and backwards of one step in 1F1B order. Communication pairs like
    Megatron's: an op's sends go in one batch with the next op's receives when the two ops differ
    (F then B: send forward + receive backward; B then F: send backward + receive forward), and in a
    batch of their own before them when the ops are alike (warm-up, cool-down)."""
    link = Link(clock)
    order = one_f_one_b(stage.stages_downstream, num_microbatches, stage.runs_backward)

    def receives(op):
        kind, i = op
        return stage.recv_forward(i) if kind == "F" else stage.recv_backward(i)

    received = link.exchange([], receives(order[0])) if order else []
    for k, (kind, i) in enumerate(order):
        if kind == "F":
            sends = stage.send_forward(i, stage.forward(i, received))
        else:
            sends = stage.send_backward(i, stage.backward(i, received))
        following = order[k + 1] if k + 1 < len(order) else None
        if following is not None and following[0] != kind:
            received = link.exchange(sends, receives(following))
        else:
            link.exchange(sends, [])
            if following is not None:
                received = link.exchange([], receives(following))
    link.finish()
