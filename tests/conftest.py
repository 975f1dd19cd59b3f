"""Test markers: `families` marks the whole layout matrix of the VLM families' training (run by
`make test-families`; `make test` deselects it).

torch.compile is off in the tests' processes (TORCH_COMPILE_DISABLE, inherited by every process a
test starts): megatron-core wraps its fused elementwise functions (bias-dropout-add, bias-GELU, ...)
in torch.compile, and on a CPU each new process traced and compiled them again at start-up, about
5 CPU seconds per rank, most of a small multi-process test. What the tests compare (a layout against
its one-process reference, our run against the stock one) runs the same eager functions on both sides;
GPU runs compile as before."""

import os

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "families: the VLM families' full layout matrix (make test-families)")
