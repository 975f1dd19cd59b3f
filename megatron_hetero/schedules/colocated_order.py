"""Which order a colocated rank runs its encoder and LLM work in when the LLM is pipelined (pp > 1).

Every rank holds a share of each encoder (pp=1, its items of each microbatch) and one LLM stage.
An encoder's forward of microbatch i must reach the LLM's first stage before that stage's forward of
i; its backward needs the first stage's backward of i. Three orders:

- "three-phase" (upstream's MIMO design, PR 4784): every encoder forward, the LLM's 1F1B, every
  encoder backward. Encoder activations of all microbatches are held at once.
- "bubbles": encoder work inside the LLM pipeline, where the stage would wait. The LLM's 1F1B is
  laid out on an ideal timeline (forward f, backward 2f per stage); encoder forward i is keyed at
  the first stage's forward of microbatch i - lookahead (so a later stage runs the first
  microbatches' encoder forwards in its warm-up), encoder backward i at the end of the first stage's
  backward of i (so a later stage runs the last ones in its cool-down). Activations of at most
  (first stage's microbatches in flight) + lookahead microbatches are held.
- "recompute" (colocated.py, not an order here): forwards without a graph first, the pipeline, then
  each microbatch's forward again with its backward.

Each rank runs its ops sorted by key (time, then encoder before LLM work, then microbatch, then
encoder). Every dependency between ranks (encoder forward -> first stage's forward, stage to stage,
first stage's backward -> encoder backward, a collective's members) goes from a smaller key to a
larger one and the keys are the same on every rank, so the orders are a valid sequential execution
of the whole step; `producer_keys` places each transfer at its producer's key, where both of its
ends exchange it (pipeline.execute_keyed). Pure functions, the same on every rank.
"""

from megatron_hetero.schedules.pipeline import Op, OpKind, one_f_one_b
from megatron_hetero.spec.layout import ColocatedSchedule

EF, EB, F, B = OpKind.EF, OpKind.EB, OpKind.F, OpKind.B
FORWARD, BACKWARD = 1.0, 2.0  # the ideal timeline's relative op lengths (backward ~ 2x forward)
LOOKAHEAD = 1  # encoder forwards run this many microbatches ahead of the first stage's need


def llm_timeline(pp: int, num_microbatches: int) -> dict[tuple[int, str, int], tuple[float, float]]:
    """(stage, "F"/"B", i) -> (start, end) of 1F1B on the ideal timeline, every stage its
    1F1B order, each op as soon as its own stage and its input (previous stage's forward, next
    stage's backward) are done."""
    orders = [one_f_one_b(pp - 1 - s, num_microbatches) for s in range(pp)]
    done: dict = {}
    free, position = [0.0] * pp, [0] * pp
    while any(position[s] < len(orders[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            while position[s] < len(orders[s]):
                kind, i = orders[s][position[s]]
                dep = (s - 1, F, i) if kind == F else (s + 1, B, i)
                if kind == B and s == pp - 1:
                    dep = (s, F, i)
                if kind == F and s == 0:
                    dep = None
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep][1] if dep is not None else 0.0)
                end = start + (FORWARD if kind == F else BACKWARD)
                done[s, kind, i], free[s] = (start, end), end
                position[s] += 1
                progressed = True
        assert progressed, "1F1B on the ideal timeline cannot stall"
    return done


def op_key(schedule: str, timeline: dict, stage: int, op: Op, encoders: list[str], lookahead: int = LOOKAHEAD) -> tuple:
    """`op`'s place in the step's one order on every rank: (time on the ideal timeline, encoder work
    before LLM work, microbatch, encoder). `encoders`: every encoder, in layout order."""
    if op.kind in (F, B):
        return (timeline[stage, op.kind, op.i][0], 1, op.i, 0)
    if schedule == ColocatedSchedule.THREE_PHASE:
        last = max(end for _, end in timeline.values())
        at = -1.0 if op.kind == EF else last + 1.0
    elif op.kind == EF:
        at = timeline[0, F, max(op.i - lookahead, 0)][0]
    else:
        at = timeline[0, B, op.i][1]
    return (at, 0, op.i, encoders.index(op.encoder))


def keyed_order(schedule: str, stage: int, pp: int, num_microbatches: int, encoders: list[str],
                trainable: list[str], lookahead: int = LOOKAHEAD, here: list[str] | None = None) -> list[tuple]:
    """The ops of a rank at LLM stage `stage` with their keys, in the order it runs them. `encoders`:
    every encoder (layout order); `trainable`: those that run a backward; `here`: those this rank
    holds (default: every one)."""
    if schedule not in (ColocatedSchedule.THREE_PHASE, ColocatedSchedule.BUBBLES):
        raise ValueError(f"colocated schedule {schedule!r} is not an order: one of three-phase, bubbles")
    assert set(trainable) <= set(encoders) and set(here or ()) <= set(encoders), (trainable, here, encoders)
    timeline = llm_timeline(pp, num_microbatches)
    ops = [Op(kind, i) for (s, kind, i) in timeline if s == stage]
    for name in encoders if here is None else here:
        ops += [Op(EF, i, name) for i in range(num_microbatches)]
        ops += [Op(EB, i, name) for i in range(num_microbatches) if name in trainable]
    return sorted((op_key(schedule, timeline, stage, op, encoders, lookahead), op) for op in ops)


def colocated_order(schedule: str, stage: int, pp: int, num_microbatches: int, encoders: list[str],
                    trainable: list[str], lookahead: int = LOOKAHEAD) -> list[Op]:
    """keyed_order's ops alone, for a rank that holds every encoder."""
    return [op for _, op in keyed_order(schedule, stage, pp, num_microbatches, encoders, trainable, lookahead)]


def producer_keys(schedule: str, stage: int, pp: int, num_microbatches: int, encoders: list[str], op: Op,
                  lookahead: int = LOOKAHEAD) -> list[tuple]:
    """The keys of the ops whose transfers `op` receives, one per transfer in the order the stage
    receives them: the first stage's forward takes each encoder's rows (layout order), from every
    rank that holds the encoder, at that encoder's forward; a later stage's forward the previous
    stage's output; a backward the next stage's gradient (the last stage: nothing); an encoder's
    backward its rows' gradients from the first stage's backward."""
    timeline = llm_timeline(pp, num_microbatches)

    def key(s: int, dep: Op) -> tuple:
        return op_key(schedule, timeline, s, dep, encoders, lookahead)

    if op.kind == F:
        return [key(stage - 1, op)] if stage > 0 else [key(0, Op(EF, op.i, e)) for e in encoders]
    if op.kind == B:
        return [key(stage + 1, op)] if stage < pp - 1 else []
    return [key(0, Op(B, op.i))] if op.kind == EB else []


def dependencies(op: Op, stage: int, pp: int, encoders: list[str]) -> list[tuple[int, Op]]:
    """(stage, op) pairs that must be done before `op` runs on `stage`, across ranks: every stage's
    encoder forwards (their rows) before the first stage's forward, the pipeline's neighbours, the
    first stage's slot gradients before an encoder backward (a stage's own earlier ops come first
    anyway)."""
    if op.kind == F:
        if stage > 0:
            return [(stage - 1, op)]
        return [(s, Op(EF, op.i, e)) for s in range(pp) for e in encoders]
    if op.kind == B:
        return [(stage + 1, op)] if stage < pp - 1 else [(stage, Op(F, op.i))]
    if op.kind == EB:
        return [(0, Op(B, op.i))]
    return []


def simulate(orders: list[list[Op]], durations, gang: bool = False) -> tuple[float, list[float]]:
    """Run every stage's order with `durations(stage, op)` (seconds); returns (the step's time, each
    stage's idle time). An op starts once its stage is free and everything it depends on is done;
    with `gang` an encoder op also starts on every stage at once (its collectives span them all).
    Raises RuntimeError if the orders deadlock."""
    pp = len(orders)
    encoders = sorted({op.encoder for order in orders for op in order if op.encoder})
    ends: dict = {}
    free, position, busy = [0.0] * pp, [0] * pp, [0.0] * pp

    def ready(stage, op):
        deps = dependencies(op, stage, pp, encoders)
        if any(dep not in ends for dep in deps):
            return None
        return max([free[stage]] + [ends[dep] for dep in deps])

    while any(position[s] < len(orders[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            if position[s] >= len(orders[s]):
                continue
            op = orders[s][position[s]]
            members = [s]
            if gang and op.kind in (EF, EB):
                members = [t for t in range(pp) if position[t] < len(orders[t]) and orders[t][position[t]] == op]
                if len(members) < pp:
                    continue
            starts = [ready(t, op) for t in members]
            if None in starts:
                continue
            start = max(starts)
            for t in members:
                ends[t, op] = free[t] = start + durations(t, op)
                busy[t] += durations(t, op)
                position[t] += 1
            progressed = True
        if not progressed:
            stuck = [orders[s][position[s]] for s in range(pp) if position[s] < len(orders[s])]
            raise RuntimeError(f"deadlock at {stuck}")
    step = max(free)
    return step, [step - b for b in busy]


def predicted_step(schedule: str, pp: int, num_microbatches: int, encoder_share: float, gang: bool = False) -> float:
    """The step's length on the ideal timeline (an LLM stage's forward = 1, backward = 2) with one
    trainable encoder whose forward per microbatch takes `encoder_share` (its backward twice that).
    "recompute" runs as three-phase with each encoder backward preceded by its forward again.
    `gang`: the encoder's ops synchronize every stage (its TP/CP groups span LLM stages)."""
    recompute = schedule == ColocatedSchedule.RECOMPUTE
    order = ColocatedSchedule.THREE_PHASE if recompute else schedule
    extra = encoder_share if recompute else 0.0

    def durations(stage, op):
        if op.kind in (EF, EB):
            return encoder_share * (BACKWARD if op.kind == EB else FORWARD) + (extra if op.kind == EB else 0.0)
        return BACKWARD if op.kind == B else FORWARD

    orders = [colocated_order(order, s, pp, num_microbatches, ["encoder"], ["encoder"]) for s in range(pp)]
    return simulate(orders, durations, gang=gang)[0]
