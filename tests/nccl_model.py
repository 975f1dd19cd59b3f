"""A model of NCCL's point-to-point semantics for checking the order in which ranks post transfers:
each rank's host runs its program (post a batch, wait for a batch, join a collective); a post is one
batch per process group, in order of first appearance (transfer.post); each rank runs the batches
posted to it one after another, whatever their groups (CUDA does not promise that two streams
progress independently: NCCL's advice is to assume they do not); inside the running batch every send
completes once the peer's matching receive (same group, same direction, the n-th of each) is in the
peer's running batch. The first message between two
ranks of a group, either way, makes their communicator (torch creates a two-rank NCCL communicator
per pair on first use, and its creation blocks both hosts): the batch that holds it is posted only
once the peer's host is posting its first message of that pair too.
A deadlock is a state where no host and no batch can move."""

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
    posting: list = field(default_factory=list)  # the current post's batches not yet posted
    queue: list = field(default_factory=list)  # [[(batch id, group), pending P2Ps]], in posting order
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
    counters, connecting = {}, {}
    while any(r.position < len(r.program) or r.queue for r in ranks):
        if not (_step_hosts(ranks, counters, connecting) | _step_groups(ranks)):
            stuck = {n: (r.program[r.position] if r.position < len(r.program) else "end",
                         r.queue[0] if r.queue else None) for n, r in enumerate(ranks)}
            raise RuntimeError(f"deadlock: {stuck}")


def _step_hosts(ranks: list[Rank], counters: dict, connecting: dict) -> bool:
    moved = False
    collective = [r.program[r.position] for r in ranks if r.position < len(r.program)
                  and r.program[r.position][0] == "collective"]
    for n, r in enumerate(ranks):
        while r.position < len(r.program):
            action = r.program[r.position]
            if action[0] == "post":
                if not _post(n, r, action, counters, connecting):
                    break
            elif action[0] == "wait":
                if any((action[1], g) not in r.done for g in r.posted[action[1]]):
                    break
            elif collective.count(action) < len(ranks):  # every rank joins (gang: all ranks)
                break
            r.position += 1
            moved = True
    return moved


def _pair(p: P2P, group: str) -> tuple:
    return (group, p.rank, p.peer) if p.send else (group, p.peer, p.rank)


def _post(n: int, r: Rank, action: tuple, counters: dict, connecting: dict) -> bool:
    """Post the action's batches in turn; False while one waits for its first messages' peers.
    `connecting`: (pair, rank) -> True once that rank's host has come to make the pair's communicator."""
    _, batch, ops = action
    if not r.posting and batch not in r.posted:
        groups: dict = {}
        for p in ops:
            groups.setdefault(p.group, []).append(p)
        r.posting, r.posted[batch] = list(groups.items()), set(groups)
    while r.posting:
        group, group_ops = r.posting[0]
        for p in group_ops:
            connecting[_pair(p, group), p.send] = True
        if not all(connecting.get((_pair(p, group), not p.send)) for p in group_ops):
            return False  # a first message whose peer has not come to make the communicator
        r.queue.append([(batch, group), [(p, _channel(p, counters)) for p in group_ops]])
        r.posting.pop(0)
    return True


def _step_groups(ranks: list[Rank]) -> bool:
    heads = {(channel, p.send): n for n, r in enumerate(ranks) if r.queue for p, channel in r.queue[0][1]}
    moved = False
    for (channel, send), n in list(heads.items()):
        if send and (channel, False) in heads:
            for m in (n, heads[channel, False]):
                ranks[m].queue[0][1] = [(p, c) for p, c in ranks[m].queue[0][1] if c != channel]
            moved = True
    for r in ranks:
        while r.queue and not r.queue[0][1]:
            r.done.add(r.queue.pop(0)[0])
            moved = True
    return moved
