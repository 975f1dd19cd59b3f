"""A rank's ops of a step in order, and the one executor of their sends and receives.

`one_f_one_b` is Megatron's non-interleaved 1F1B order (`forward_backward_pipelining_without_interleaving`):
a stage with k stages downstream of it runs min(k, M) forwards (warm-up), then alternates one
forward and one backward (steady state), then drains the backwards (cool-down). A stage without
backward (a frozen module) runs every forward ahead. colocated_order.py orders a colocated rank's
encoder and LLM ops the same way, as Ops.

`execute` runs a stage's order: each op's receives are posted and waited for, the op computes, its
sends are posted (waited for at the step's end, so that no op blocks on a neighbour not ready to
receive). `run_stage` executes one stage's 1F1B order with Megatron's pairing of communication (an
op's sends in one batch with the next op's receives when the two differ: send forward + receive
backward, send backward + receive forward), which keeps NCCL's in-order point-to-point streams from
deadlocking. `execute_keyed` runs orders whose ops carry keys of one global order (a colocated
rank's encoder and LLM work, colocated_order.py), where no such pairing exists: NCCL runs a rank's
transfers in the order it posted them (across groups too: CUDA does not promise that two streams
progress apart) and a send waits for its receive, so both ends exchange every transfer at the same
point of that order, its producer's: the send right after the op that computes it, the receive
after the receiving rank's last op whose key is not greater than the producer's. The stage decides
what a microbatch's forward and backward are and which transfers feed them (a boundary, a
neighbouring stage of its module, or nothing); this file orders them.
"""

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_hetero.boundary.transfer import Transfer, post
from megatron_hetero.runtime.timers import Clock


class OpKind(StrEnum):
    """A unit of a rank's work on one microbatch."""

    F = "F"  # the LLM stage's (or a pipelined module stage's) forward
    B = "B"  # its backward
    EF = "EF"  # a colocated encoder's forward
    EB = "EB"  # a colocated encoder's backward

    def __repr__(self) -> str:
        return repr(self.value)


@dataclass(frozen=True, order=True)
class Op:
    """One unit of a rank's work: `kind` on microbatch `i` (`encoder`: the encoder of EF/EB)."""

    kind: OpKind
    i: int
    encoder: str = ""


def warmup_microbatches(stages_downstream: int, num_microbatches: int) -> int:
    """Forwards a stage runs before its first backward."""
    return min(stages_downstream, num_microbatches)


def one_f_one_b(stages_downstream: int, num_microbatches: int, backward: bool = True) -> list[tuple[OpKind, int]]:
    """The stage's compute order: (F, i) / (B, i), i the microbatch."""
    F, B = OpKind.F, OpKind.B
    if not backward:
        return [(F, i) for i in range(num_microbatches)]
    warmup = warmup_microbatches(stages_downstream, num_microbatches)
    order = [(F, i) for i in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [(F, warmup + i), (B, i)]
    return order + [(B, i) for i in range(num_microbatches - warmup, num_microbatches)]


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


Receives = Callable[[Op], list[Transfer]]
Compute = Callable[[Op, list], list[Transfer]]


def execute(order: list[Op], receives: Receives, compute: Compute, clock: Clock,
            paired: Callable[[Op, Op], bool] = lambda op, following: False,
            phase: Callable[[Op], object] = lambda op: nullcontext()) -> None:
    """Run `order`: for each op, its `receives(op)` posted and waited for, `compute(op, received)`
    (which returns the op's sends), its sends posted. `paired(op, following)`: op's sends go in one
    batch with the following op's receives; `phase(op)`: the context an op's transfers run in (a
    timer)."""
    link = Link(clock)
    received = []
    if order:
        with phase(order[0]):
            received = link.exchange([], receives(order[0]))
    for k, op in enumerate(order):
        sends = compute(op, received)
        following = order[k + 1] if k + 1 < len(order) else None
        with phase(op):
            if following is not None and paired(op, following):
                received = link.exchange(sends, receives(following))
                continue
            link.exchange(sends, [])
        if following is not None:
            with phase(following):
                received = link.exchange([], receives(following))
    link.finish()


def execute_keyed(order: list[tuple[tuple, Op]], producer_keys: Callable[[Op], list[tuple]],
                  receive: Callable[[Op, int], Transfer], compute: Compute, clock: Clock,
                  phase: Callable[[Op], object] = lambda op: nullcontext()) -> None:
    """Run `order` ((key, op), sorted by keys that every rank shares) exchanging each transfer at
    its producer's point of the one order: `producer_keys(op)` are the keys of the ops whose
    transfers `op` receives, one per transfer, and `receive(op, j)` builds the j-th. After each op,
    two batches, each waited for at once: its sends with the receives whose producers share its key
    (ranks that send each other rows at the same point), then the receives whose producers come
    before this rank's next op. Both ends of a transfer post it at the same point of the order, one
    batch in flight per rank: nothing waits on a rank that waits on it, and each direction's first
    message (which NCCL connects on first use, blocking both hosts) is posted by both ends before
    either needs anything more from the other (tests/test_nccl_order.py checks every order against
    a model of this)."""
    keys = [key for key, _ in order]
    after = defaultdict(list)  # m -> (op n, its transfer j, the producer's key), posted after op m
    for n, (key, op) in enumerate(order):
        for j, produced in enumerate(producer_keys(op)):
            assert produced < key, (op, produced, key)
            after[bisect_right(keys, produced) - 1].append((n, j, produced))
    received = defaultdict(dict)  # n -> j -> the j-th transfer's result

    def exchange(sends: list[Transfer], parts: list[tuple[int, int]]) -> None:
        transfers = [receive(order[n][1], j) for n, j in parts]
        clock.wait(post(sends + transfers))
        for (n, j), t in zip(parts, transfers):
            received[n][j] = t.result()

    def post_after(m: int, sends: list[Transfer]) -> None:
        key = keys[m] if m >= 0 else None
        if m >= 0:
            with phase(order[m][1]):  # ranks sending each other at this key go in one batch
                exchange(sends, [(n, j) for n, j, produced in after[m] if produced == key])
        later = [(n, j) for n, j, produced in after[m] if produced != key]
        if later:
            with phase(order[later[0][0]][1]):
                exchange([], later)

    post_after(-1, [])
    for n, (_, op) in enumerate(order):
        parts = received.pop(n, {})
        post_after(n, compute(op, [parts[j] for j in sorted(parts)]))


def steady_pairs(stages_downstream: int, num_microbatches: int) -> Callable[[Op, Op], bool]:
    """Megatron's pairing in 1F1B: an op's sends with the next op's receives where the two differ,
    but a warm-up forward's alone (with no steady state the backward direction's first message
    would share its batch: NCCL connects each direction on first use, blocking both hosts, and that
    message's sender needs the forward's first)."""
    warmup = warmup_microbatches(stages_downstream, num_microbatches)
    return lambda op, following: op.kind != following.kind and not (op.kind == OpKind.F and op.i < warmup)


@dataclass
class StageResults:
    """What a stage's ops returned per microbatch: forward outputs (the LLM's last stage: its loss,
    or logits) and backward gradients (the LLM's first stage: each encoder's row gradients)."""

    forward: dict = field(default_factory=dict)
    backward: dict = field(default_factory=dict)


def run_stage(stage: Stage, num_microbatches: int, clock: Clock) -> StageResults:
    """Run the stage's forwards and backwards of one step in 1F1B order, with Megatron's pairing of
    communication (`steady_pairs`): in the steady state an op's sends in one batch with the next
    op's receives (F then B: send forward + receive backward; B then F: send backward + receive
    forward), elsewhere (warm-up, cool-down) in a batch of their own."""
    results = StageResults()

    def receives(op: Op) -> list[Transfer]:
        return stage.recv_forward(op.i) if op.kind == OpKind.F else stage.recv_backward(op.i)

    def compute(op: Op, received: list) -> list[Transfer]:
        if op.kind == OpKind.F:
            results.forward[op.i] = outputs = stage.forward(op.i, received)
            return stage.send_forward(op.i, outputs)
        results.backward[op.i] = grads = stage.backward(op.i, received)
        return stage.send_backward(op.i, grads)

    order = [Op(kind, i) for kind, i in one_f_one_b(stage.stages_downstream, num_microbatches, stage.runs_backward)]
    execute(order, receives, compute, clock, paired=steady_pairs(stage.stages_downstream, num_microbatches))
    return results
