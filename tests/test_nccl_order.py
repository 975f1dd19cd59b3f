"""The order in which each rank posts its transfers, run through a model of NCCL's in-order
point-to-point semantics (tests/nccl_model.py), for every order a step can take with a pipelined
LLM: Megatron's 1F1B with its pairing (run_stage) and the colocated orders (execute_keyed). gloo
buffers sends, so the parity tests cannot see an order that NCCL deadlocks on; this can. The model
is checked on an order known to hang on NCCL: 1F1B without the pairing."""

import pytest

from megatron_hetero.boundary.transfer import Transfer
from megatron_hetero.schedules import pipeline
from megatron_hetero.schedules.colocated_order import keyed_order, producer_keys
from megatron_hetero.schedules.pipeline import Op, OpKind, execute, execute_keyed, one_f_one_b, steady_pairs
from tests.nccl_model import P2P, run

F, B, EF, EB = OpKind.F, OpKind.B, OpKind.EF, OpKind.EB


class Recorder:
    """A rank's host program as the executor writes it: posts and waits (with `post` replaced)."""

    def __init__(self):
        self.program, self.batches, self.waited = [], 0, set()

    def post(self, transfers):
        self.batches += 1
        self.program.append(("post", self.batches, [p for t in transfers for p in t.ops]))
        return [self.batches]

    def wait(self, works):
        assert not self.waited & set(works), "a second wait on a receive never returns on gloo"
        self.waited |= set(works)
        self.program += [("wait", work) for work in works]


def transfers(rank: int, peers, send: bool, group: str) -> list[Transfer]:
    ops = [P2P(rank, peer, send, group) for peer in peers if peer != rank]
    return [Transfer(ops)] if ops else []


class StageModel:
    """What each op of a colocated rank at LLM stage `s` sends and receives (one rank per stage;
    encoders on `holders` ranks, their rows into stage 0; `gang`: encoder ops are collectives over
    every rank)."""

    def __init__(self, s, pp, encoders, trainable, holders, recorder, gang=False):
        self.s, self.pp, self.encoders, self.trainable = s, pp, encoders, trainable
        self.holders, self.recorder, self.gang = holders, recorder, gang

    def receives(self, op):
        s, pp = self.s, self.pp
        if op.kind == F:
            if s > 0:
                return transfers(s, [s - 1], False, "pp")
            return [t for _ in self.encoders for t in transfers(0, self.holders, False, "rows")]
        if op.kind == B:
            return transfers(s, [s + 1], False, "pp") if s < pp - 1 else []
        return transfers(s, [0], False, "grads") if op.kind == EB else []

    def receive(self, op, j):
        """The j-th of producer_keys(op) (on the first stage, encoder j's rows from its holders)."""
        s = self.s
        peers, group = {F: ([s - 1], "pp"), B: ([s + 1], "pp"), EB: ([0], "grads")}[op.kind]
        if op.kind == F and s == 0:
            peers, group = self.holders, "rows"
        return Transfer([P2P(s, peer, False, group) for peer in peers if peer != s])

    def compute(self, op, received):
        s, pp = self.s, self.pp
        if op.kind in (EF, EB) and self.gang:
            self.recorder.program.append(("collective", op))
        if op.kind == EF:
            return transfers(s, [0], True, "rows")
        if op.kind == F:
            return transfers(s, [s + 1], True, "pp") if s < pp - 1 else []
        if op.kind == B:
            if s > 0:
                return transfers(s, [s - 1], True, "pp")
            return [t for e in self.trainable for t in transfers(0, self.holders, True, "grads")]
        return []


def colocated_programs(monkeypatch, schedule, pp, m, encoders, trainable, stacked=False, gang=False):
    programs = []
    for s in range(pp):
        recorder = Recorder()
        monkeypatch.setattr(pipeline, "post", recorder.post)
        here = encoders if not stacked or s == 0 else []
        model = StageModel(s, pp, encoders, trainable, [0] if stacked else range(pp), recorder, gang)
        order = keyed_order(schedule, s, pp, m, encoders, trainable, here=here)
        execute_keyed(order, lambda op, s=s: producer_keys(schedule, s, pp, m, encoders, op), model.receive,
                      model.compute, recorder)
        programs.append(recorder.program)
    return programs


def one_f_one_b_programs(monkeypatch, pp, m, paired):
    programs = []
    for s in range(pp):
        recorder = Recorder()
        monkeypatch.setattr(pipeline, "post", recorder.post)
        model = StageModel(s, pp, [], [], [], recorder)
        order = [Op(kind, i) for kind, i in one_f_one_b(pp - 1 - s, m)]
        execute(order, model.receives, model.compute, recorder,
                paired=steady_pairs(pp - 1 - s, m) if paired else (lambda op, following: False))
        programs.append(recorder.program)
    return programs


def test_the_model_finds_nccl_deadlocks(monkeypatch):
    """1F1B with each send in a batch of its own hangs on NCCL (send forward of microbatch 1 ahead
    of receive backward of 0 on one rank, the reverse on the other); Megatron's pairing does not."""
    with pytest.raises(RuntimeError, match="deadlock"):
        run(one_f_one_b_programs(monkeypatch, 2, 3, paired=False))
    for pp, m in [(2, 1), (2, 3), (3, 5), (4, 8)]:
        run(one_f_one_b_programs(monkeypatch, pp, m, paired=True))


@pytest.mark.parametrize("schedule", ["three-phase", "bubbles"])
@pytest.mark.parametrize("pp,m", [(2, 1), (2, 2), (2, 4), (3, 5), (4, 8)])
@pytest.mark.parametrize("encoders,trainable,stacked", [
    (["vision"], ["vision"], False), (["vision", "audio"], ["vision", "audio"], False),
    (["vision", "audio"], ["audio"], False), (["vision"], ["vision"], True), (["vision"], [], False)])
def test_colocated_orders_post_transfers_nccl_can_run(monkeypatch, schedule, pp, m, encoders, trainable, stacked):
    """With each encoder's collectives within a rank or spanning every rank (`gang`: an encoder
    with TP across the LLM's stages, whose ranks must all be in its op at once; a stacked encoder
    is on the first stage only)."""
    for gang in (False,) if stacked else (False, True):
        run(colocated_programs(monkeypatch, schedule, pp, m, encoders, trainable, stacked, gang))
