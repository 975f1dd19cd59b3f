"""The 1F1B order (pure): Megatron's warm-up / steady state / cool-down for any stage and count."""

import pytest

from megatron_hetero.schedules.pipeline import one_f_one_b


@pytest.mark.parametrize("downstream", [0, 1, 2, 3, 5])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 8])
def test_one_f_one_b(downstream, microbatches):
    order = one_f_one_b(downstream, microbatches)
    forwards = [i for op, i in order if op == "F"]
    backwards = [i for op, i in order if op == "B"]
    assert forwards == backwards == list(range(microbatches))
    warmup = min(downstream, microbatches)
    assert order[:warmup] == [("F", i) for i in range(warmup)]
    # In flight (forward done, backward not yet): at most warm-up + 1, so activation memory is
    # bounded by the stages downstream, not by the number of microbatches.
    in_flight, peak = 0, 0
    for op, i in order:
        in_flight += 1 if op == "F" else -1
        peak = max(peak, in_flight)
        if op == "B":
            assert ("F", i) in order[: order.index(("B", i))]
    assert peak == min(warmup + 1, microbatches)
    # Steady state alternates one forward and one backward.
    steady = order[warmup : 2 * microbatches - warmup]
    assert [op for op, _ in steady] == ["F", "B"] * (microbatches - warmup)


def test_forward_only_runs_ahead():
    assert one_f_one_b(3, 4, backward=False) == [("F", i) for i in range(4)]
