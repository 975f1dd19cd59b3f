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


def assert_compiled_equals_eager(call, leaves, dout, tol):
    """`call(compiled, *inputs)` compiled and then eager, each on fresh copies of `leaves` with `dout` as the
    output's gradient: the outputs and every input's gradient (None in both where the call does not use it)
    equal within `tol`."""
    results = []
    for on in (True, False):
        inputs = [t.clone().requires_grad_() for t in leaves]
        with compiling(on):
            out = call(on, *inputs)
        out.backward(dout)
        results.append([out.detach()] + [t.grad for t in inputs])
    for compiled, eager in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=tol, atol=tol)
