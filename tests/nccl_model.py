"""A model of NCCL's point-to-point semantics for checking the order in which ranks post transfers:
each rank's host runs its program (post a batch, wait for a batch, join a collective); on each rank
each process group runs the batches posted to it one after another (a group's kernels on its
stream); inside the running batch every send completes once the peer's matching receive (same
group, same direction, the n-th of each) is in the peer's running batch of that group. A deadlock is
a state where no host and no batch can move."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class P2P:
    """One side of a transfer: `rank` sends to / receives from `peer` on process group `group`."""

    rank: int
    peer: int
    send: bool
    group: str = "pp"


@dataclass
class Rank:
    program: list  # ("post", batch id, [P2P]) / ("wait", batch id) / ("collective", name)
    position: int = 0
    queues: dict = field(default_factory=dict)  # group -> [[batch id, pending P2Ps]]
    done: set = field(default_factory=set)  # completed (batch id, group)
    posted: dict = field(default_factory=dict)  # batch id -> its groups


def _channel(p: P2P, counters: dict) -> tuple:
    src, dst = (p.rank, p.peer) if p.send else (p.peer, p.rank)
    key = (p.group, src, dst, p.send)
    counters[key] = counters.get(key, 0) + 1
    return (p.group, src, dst, counters[key])


def run(programs: list[list]) -> None:
    """Run every rank's program; raises RuntimeError naming what each rank waits for on a deadlock."""
    ranks = [Rank(program) for program in programs]
    counters: dict = {}
    while any(r.position < len(r.program) or any(r.queues.values()) for r in ranks):
        if not (_step_hosts(ranks, counters) | _step_groups(ranks)):
            stuck = {n: (r.program[r.position] if r.position < len(r.program) else "end",
                         {g: q[0][1] for g, q in r.queues.items() if q}) for n, r in enumerate(ranks)}
            raise RuntimeError(f"deadlock: {stuck}")


def _step_hosts(ranks: list[Rank], counters: dict) -> bool:
    moved = False
    collective = [r.program[r.position] for r in ranks if r.position < len(r.program)
                  and r.program[r.position][0] == "collective"]
    for r in ranks:
        while r.position < len(r.program):
            action = r.program[r.position]
            if action[0] == "post":
                _, batch, ops = action
                groups = {}
                for p in ops:
                    groups.setdefault(p.group, []).append((p, _channel(p, counters)))
                for group, pending in groups.items():
                    r.queues.setdefault(group, []).append([batch, pending])
                r.posted[batch] = set(groups)
            elif action[0] == "wait":
                if any((action[1], g) not in r.done for g in r.posted[action[1]]):
                    break
            elif collective.count(action) < len(ranks):  # every rank joins (gang: all ranks)
                break
            r.position += 1
            moved = True
    return moved


def _step_groups(ranks: list[Rank]) -> bool:
    heads = {}
    for n, r in enumerate(ranks):
        for group, queue in r.queues.items():
            if queue:
                for p, channel in queue[0][1]:
                    heads[channel, p.send] = (n, group)
    moved = False
    for (channel, send), (n, group) in list(heads.items()):
        if send and (channel, False) in heads:
            for (c, s), (m, g) in (((channel, True), (n, group)), ((channel, False), heads[channel, False])):
                head = ranks[m].queues[g][0]
                head[1] = [(p, ch) for p, ch in head[1] if ch != c]
            moved = True
    for r in ranks:
        for group, queue in r.queues.items():
            while queue and not queue[0][1]:
                r.done.add((queue.pop(0)[0], group))
                moved = True
    return moved
