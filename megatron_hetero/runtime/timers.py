"""How a rank's step time is spent: `Clock` (the time blocked on other ranks' data, the waiting share
each run reports), `PhaseTimers`, named phase timers for step-time breakdowns (Megatron's
`timers('forward-compute')` idea), and `Traffic`, the bytes each module sends and receives across
the boundary, counted from the step's plans (no communication).

PhaseTimers:

Off by default: a disabled timer is a no-op context. On, each phase synchronizes the GPU at its
start and end, so that the time is the phase's own (this serializes what would otherwise overlap:
use it to see where time goes, not to measure peak throughput). Phases nest, and a phase's time
excludes the phases inside it (an encoder's forward called from within the LLM's forward step
counts as the encoder's only); `switch` relabels the running phase where one call spans several
(one autograd backward through the LLM, the boundary and the encoder).

On, each interval charged to a phase is also kept in `spans` as (phase, module, start, end) in
seconds of the host's monotonic clock (the same clock in every process of a node), and, where the
Clock shares the list, each wait as ("waiting", None, start, end): a step's timeline, which the
metrics writer takes after every iteration; and each phase as it opens (or a switch relabels it) in
`opened` as (phase, module): the order of the work (a phase that nested ones interrupt is one entry,
as is a switch to the phase already open).

On or off, the innermost open phase is `current` and the module it runs, where one was named,
`current_module` (a failure report names them; a phase an exception leaves stays current)."""

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch


class PhaseTimers:
    def __init__(self, device: torch.device, enabled: bool = False):
        self.device, self.enabled = device, enabled
        self.seconds = defaultdict(float)
        self.spans = []  # (phase, module, start, end), while enabled
        self.opened = []  # (phase, module) as each opens or is switched to, while enabled
        self._running = []  # [name, since, module] of the open phases, innermost last

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _charge_innermost(self, now: float) -> None:
        """The innermost open phase's time up to `now`; it counts again from `now`."""
        if self._running:
            phase = self._running[-1]
            self.seconds[phase[0]] += now - phase[1]
            if now > phase[1]:
                self.spans.append((phase[0], phase[2], phase[1], now))
            phase[1] = now

    @contextmanager
    def _timed(self, name: str, module: str | None):
        now = self._now()
        self._charge_innermost(now)  # the enclosing phase pauses
        self._running.append([name, now, module])
        self.opened.append((name, module))
        try:
            yield
        finally:
            now = self._now()
            self._charge_innermost(now)
            self._running.pop()
            if self._running:  # and resumes
                self._running[-1][1] = now

    @contextmanager
    def _named(self, name: str, module: str | None):
        self._running.append([name, None, module])
        yield
        self._running.pop()

    def __call__(self, name: str, module: str | None = None):
        """The phase `name` (of `module`, where it runs one module's work) inside."""
        return self._timed(name, module) if self.enabled else self._named(name, module)

    @property
    def current(self) -> str | None:
        return self._running[-1][0] if self._running else None

    @property
    def current_module(self) -> str | None:
        return self._running[-1][2] if self._running else None

    def switch(self, name: str, module: str | None = None) -> None:
        """From now on the innermost open phase counts as `name` of `module` (None: of no one module;
        nothing when off or none is open)."""
        if self.enabled and self._running:
            self._charge_innermost(self._now())
            if (self._running[-1][0], self._running[-1][2]) != (name, module):
                self.opened.append((name, module))
            self._running[-1][0], self._running[-1][2] = name, module

    def reset(self):
        self.seconds.clear()
        self.spans.clear()
        self.opened.clear()


# The phases the schedules time, in a step's order (the writers report these).
PHASES = ("encoder-forward", "boundary", "llm-forward", "llm-backward", "encoder-backward", "optimizer")


class Traffic:
    """Bytes this rank's modules sent and received across the boundary to and from other ranks in
    training steps, per module: forward, an encoder's rows (sent) to the LLM (received); backward,
    their gradients the other way. Rows that stay on the rank are not counted."""

    def __init__(self, row_bytes: int):
        self.row_bytes = row_bytes  # a boundary row's (its width times its dtype's size; gradients alike)
        self.sent, self.received = defaultdict(int), defaultdict(int)
        self.steps = 0  # the training steps counted

    def add(self, plans: dict, llm: str) -> None:
        """A training step's plans (encoder name -> the RankPlan of every microbatch)."""
        self.steps += 1
        row_bytes = self.row_bytes
        for encoder, rank_plans in plans.items():
            for plan in rank_plans:
                for routes, sender, receiver in ((plan.forward, encoder, llm), (plan.backward, llm, encoder)):
                    self.sent[sender] += row_bytes * int(routes.send_counts.sum() - routes.send_counts[plan.rank])
                    self.received[receiver] += row_bytes * int(routes.recv_counts.sum() - routes.recv_counts[plan.rank])


@dataclass
class Reported:
    """What the metrics writers were last given on this rank: the Clock's waiting and step seconds,
    the phase seconds and boundary bytes as gathered (`totals`), and the training steps they cover;
    each report gives the difference since the last."""

    waiting_s: float = 0.0
    step_s: float = 0.0
    totals: torch.Tensor | None = None
    steps: int = 0


def timeline_file(metrics_file: str, rank: int | str) -> str:
    """Where rank `rank` writes its steps' timelines beside the run's --metrics-file ("*": a glob of all)."""
    return f"{metrics_file}.timeline.rank{rank}.jsonl"


@dataclass
class Clock:
    """Time this rank spends blocked on data from other ranks (on GPUs, after draining its own
    queued compute, so that its compute is not counted as waiting)."""

    device: torch.device
    waiting_s: float = 0.0
    step_s: float = 0.0  # training steps' forward-backward time, the waiting share's denominator
    spans: list | None = None  # where given (the phase timers' spans), each wait is appended

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
            end = time.perf_counter()
            self.waiting_s += end - start
            if self.spans is not None:
                self.spans.append(("waiting", None, start, end))

    def wait(self, works) -> None:
        if not works:
            return
        with self.blocked():
            for work in works:
                work.wait()
