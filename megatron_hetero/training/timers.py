"""Named phase timers for step-time breakdowns (Megatron's `timers('forward-compute')` idea).

Off by default: a disabled timer is a no-op context. On, each phase synchronizes the GPU at its
start and end, so that the time is the phase's own (this serializes what would otherwise overlap:
use it to see where time goes, not to measure peak throughput). Phases nest, and a phase's time
excludes the phases inside it (an encoder's forward called from within the LLM's forward step
counts as the encoder's only); `switch` relabels the running phase where one call spans several
(one autograd backward through the LLM, the boundary and the encoder).

On or off, the innermost open phase is `current` (a failure report names it; a phase an exception
leaves stays current)."""

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class PhaseTimers:
    def __init__(self, device: torch.device, enabled: bool = False):
        self.device, self.enabled = device, enabled
        self.seconds = defaultdict(float)
        self._running = []  # [name, since] of the open phases, innermost last

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _charge_innermost(self, now: float) -> None:
        """The innermost open phase's time up to `now`; it counts again from `now`."""
        if self._running:
            phase = self._running[-1]
            self.seconds[phase[0]] += now - phase[1]
            phase[1] = now

    @contextmanager
    def _timed(self, name: str):
        now = self._now()
        self._charge_innermost(now)  # the enclosing phase pauses
        self._running.append([name, now])
        try:
            yield
        finally:
            now = self._now()
            self._charge_innermost(now)
            self._running.pop()
            if self._running:  # and resumes
                self._running[-1][1] = now

    @contextmanager
    def _named(self, name: str):
        self._running.append([name, None])
        yield
        self._running.pop()

    def __call__(self, name: str):
        return self._timed(name) if self.enabled else self._named(name)

    @property
    def current(self) -> str | None:
        return self._running[-1][0] if self._running else None

    def switch(self, name: str) -> None:
        """From now on the innermost open phase counts as `name` (nothing when off or none is open)."""
        if self.enabled and self._running:
            self._charge_innermost(self._now())
            self._running[-1][0] = name

    def reset(self):
        self.seconds.clear()
