"""torch.compile inside one test: the tests' processes run with it off (conftest.py), so a test of a function
that GPUs run compiled turns it on around the call and checks that a graph was compiled."""

from contextlib import contextmanager

import torch


@contextmanager
def compiling(on: bool):
    """torch.compile on (`on`) or off inside the block; on leaving, that a graph was compiled exactly when on."""
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(disable=not on):
        yield
    assert bool(torch._dynamo.utils.counters["stats"]["unique_graphs"]) == on
