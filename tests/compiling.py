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


def outputs_and_gradients(call, leaves, dout, compiled: bool = False) -> list:
    """`call(*inputs)` on fresh copies of `leaves` (torch.compile on where `compiled`: a function that GPUs
    run compiled), `dout` as the output's gradient: the output, then each input's gradient."""
    inputs = [t.clone().requires_grad_() for t in leaves]
    with torch._dynamo.config.patch(disable=not compiled):
        out = call(*inputs)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in inputs]


def assert_compiled_equals_eager(call, leaves, dout, tol):
    """`call(compiled, *inputs)` compiled and then eager, each on fresh copies of `leaves` with `dout` as the
    output's gradient: the outputs and every input's gradient (None in both where the call does not use it)
    equal within `tol`."""
    results = []
    for on in (True, False):
        with compiling(on):
            results.append(outputs_and_gradients(lambda *inputs, on=on: call(on, *inputs), leaves, dout, on))
    for compiled, eager in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=tol, atol=tol)
