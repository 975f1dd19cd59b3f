"""Named phase timers for step-time breakdowns (Megatron's `timers('forward-compute')` idea).

Off by default: a disabled timer is a no-op context. On, each phase synchronizes the GPU at its
start and end, so that the time is the phase's own (this serializes what would otherwise overlap:
use it to see where time goes, not to measure peak throughput)."""

import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch


class PhaseTimers:
    def __init__(self, device: torch.device, enabled: bool = False):
        self.device, self.enabled = device, enabled
        self.seconds = defaultdict(float)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def _timed(self, name: str):
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] += time.perf_counter() - start

    def __call__(self, name: str):
        return self._timed(name) if self.enabled else nullcontext()

    def reset(self):
        self.seconds.clear()
