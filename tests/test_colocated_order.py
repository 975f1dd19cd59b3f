"""The orders of a colocated step with a pipelined LLM (schedules/colocated_order.py), against what
the step needs: every op once, the LLM stage in Megatron's 1F1B order, no deadlock whether an
encoder's collectives span every stage or none, encoder activations bounded, and the bubbles filled
(a shorter step than three-phase on the ideal timeline whenever the pipeline has bubbles)."""

import itertools

import pytest

from megatron_hetero.schedules.colocated_order import (
    LOOKAHEAD,
    Op,
    colocated_order,
    llm_timeline,
    predicted_step,
    simulate,
)
from megatron_hetero.schedules.pipeline import one_f_one_b

ENCODER_SETS = [(["vision"], ["vision"]), (["vision", "audio"], ["vision", "audio"]), (["vision", "audio"], ["audio"]),
                (["vision"], [])]


def orders(schedule, pp, m, encoders, trainable, lookahead=LOOKAHEAD):
    return [colocated_order(schedule, s, pp, m, encoders, trainable, lookahead) for s in range(pp)]


def held_at_most(order: list[Op]) -> int:
    """Most microbatches whose encoder forward ran and backward has not (per encoder)."""
    held, most = set(), 0
    for op in order:
        if op.kind == "EF" and any(o == Op("EB", op.i, op.encoder) for o in order):
            held.add((op.encoder, op.i))
        elif op.kind == "EB":
            held.discard((op.encoder, op.i))
        most = max(most, max([sum(1 for e, _ in held if e == name) for name, _ in held] or [0]))
    return most


@pytest.mark.parametrize("schedule", ["three-phase", "bubbles"])
@pytest.mark.parametrize("pp,m", [(2, 1), (2, 2), (2, 5), (3, 2), (3, 7), (4, 4), (4, 9)])
@pytest.mark.parametrize("encoders,trainable", ENCODER_SETS)
def test_orders_are_complete_and_deadlock_free(schedule, pp, m, encoders, trainable):
    for lookahead in (0, 1, 2):
        stages = orders(schedule, pp, m, encoders, trainable, lookahead)
        for s, order in enumerate(stages):
            assert len(order) == len(set(order))
            assert [(op.kind, op.i) for op in order if op.kind in "FB"] == one_f_one_b(pp - 1 - s, m)
            assert {op for op in order if op.kind == "EF"} == {Op("EF", i, e) for i in range(m) for e in encoders}
            assert {op for op in order if op.kind == "EB"} == {Op("EB", i, e) for i in range(m) for e in trainable}
            # an encoder's ops in microbatch order (their messages pair up in order on each group)
            for kind, e in itertools.product(("EF", "EB"), encoders):
                mine = [op.i for op in order if op.kind == kind and op.encoder == e]
                assert mine == sorted(mine)
            if schedule == "bubbles" and trainable:
                assert held_at_most(order) <= pp + lookahead
        for gang in (False, True):  # collectives within a stage / spanning every stage
            simulate(stages, lambda s, op: 1.0, gang=gang)  # raises on a deadlock


def test_a_dependency_out_of_order_deadlocks():
    """The checker finds a deadlock: the first stage's forward of microbatch 0 before the second
    stage has sent its rows."""
    stages = orders("bubbles", 2, 3, ["vision"], ["vision"])
    stages[1].remove(Op("EF", 0, "vision"))
    stages[1].append(Op("EF", 0, "vision"))
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(stages, lambda s, op: 1.0)


def test_timeline_is_1f1b():
    timeline = llm_timeline(3, 4)
    assert timeline[0, "F", 0] == (0.0, 1.0) and timeline[2, "F", 0] == (2.0, 3.0)
    assert timeline[2, "B", 0] == (3.0, 5.0) and timeline[0, "B", 0] == (7.0, 9.0)


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (4, 8), (4, 16)])
@pytest.mark.parametrize("encoder_share", [0.1, 0.3, 1.0])
def test_bubbles_shorten_the_step(pp, m, encoder_share):
    """On durations where backward is twice forward for both modules, filling the bubbles gives a
    shorter step than three-phase, and less idle time per stage."""
    def durations(stage, op):
        base = encoder_share if op.kind in ("EF", "EB") else 1.0
        return base * (2.0 if op.kind in ("B", "EB") else 1.0)

    three, three_idle = simulate(orders("three-phase", pp, m, ["vision"], ["vision"]), durations)
    bubbles, bubbles_idle = simulate(orders("bubbles", pp, m, ["vision"], ["vision"]), durations)
    assert bubbles < three
    assert sum(bubbles_idle) < sum(three_idle)


@pytest.mark.parametrize("pp,m,share", [(2, 8, 1.0), (4, 16, 0.3)])
def test_predicted_steps(pp, m, share):
    """recompute = three-phase plus one encoder forward per microbatch on the first stage (its
    tail); bubbles shortest where encoder ops need no other stage, but longer than three-phase when
    they gang every stage (an encoder TP group across LLM stages): its ops then wait on the
    slowest stage's pipeline position."""
    three = predicted_step("three-phase", pp, m, share)
    assert predicted_step("recompute", pp, m, share) == pytest.approx(three + m * share)
    assert predicted_step("bubbles", pp, m, share) < three
    assert predicted_step("bubbles", pp, m, share, gang=True) > predicted_step("three-phase", pp, m, share, gang=True)
