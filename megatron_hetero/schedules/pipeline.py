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
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_hetero.boundary.exchange import Transfer, post


def warmup_microbatches(stages_downstream: int, num_microbatches: int) -> int:
    """Forwards a stage runs before its first backward."""
    return min(stages_downstream, num_microbatches)


def one_f_one_b(stages_downstream: int, num_microbatches: int, backward: bool = True) -> list[tuple[str, int]]:
    """The stage's compute order: ("F", i) / ("B", i), i the microbatch (pure: for tests and docs)."""
    if not backward:
        return [("F", i) for i in range(num_microbatches)]
    warmup = warmup_microbatches(stages_downstream, num_microbatches)
    order = [("F", i) for i in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(num_microbatches - warmup, num_microbatches)]


def stage_send(tensor: torch.Tensor, peer: int) -> Transfer:
    """A tensor for the neighbouring stage `peer` (a global rank)."""
    return Transfer([dist.P2POp(dist.isend, tensor.contiguous(), peer)])


def stage_recv(like: torch.Tensor, peer: int) -> Transfer:
    """A tensor shaped and typed like `like` from the neighbouring stage `peer`."""
    buffer = torch.empty_like(like)
    return Transfer([dist.P2POp(dist.irecv, buffer, peer)], dest=buffer)


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
    queued work, so that its compute is not counted as waiting)."""

    device: torch.device
    waiting_s: float = 0.0

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wait(self, works) -> None:
        if not works:
            return
        self._sync()
        start = time.perf_counter()
        for work in works:
            work.wait()
        self._sync()
        self.waiting_s += time.perf_counter() - start


@dataclass
class _Link:
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
    """Run the stage's forwards and backwards of one step in 1F1B order (see the module doc)."""
    link = _Link(clock)
    m = num_microbatches
    warmup = m if not stage.runs_backward else warmup_microbatches(stage.stages_downstream, m)

    def forward(i, received):
        outputs = stage.forward(i, received)
        return stage.send_forward(i, outputs)

    for i in range(warmup):
        sends = forward(i, link.exchange([], stage.recv_forward(i)))
        link.exchange(sends, [])
    received = link.exchange([], stage.recv_forward(warmup)) if warmup < m else None
    for k in range(m - warmup):
        i, j = warmup + k, k  # forward of microbatch i, then backward of microbatch j
        grads_in = link.exchange(forward(i, received), stage.recv_backward(j))
        sends = stage.send_backward(j, stage.backward(j, grads_in))
        received = link.exchange(sends, stage.recv_forward(i + 1) if i + 1 < m else [])
    if stage.runs_backward:
        for j in range(m - warmup, m):
            grads_in = link.exchange([], stage.recv_backward(j))
            link.exchange(stage.send_backward(j, stage.backward(j, grads_in)), [])
    link.finish()
