"""Test markers: `families` marks the whole layout matrix of the VLM families' training (run by
`make test-families`; `make test` deselects it).

torch.compile is off in the tests' processes (TORCH_COMPILE_DISABLE, inherited by every process a
test starts): megatron-core wraps its fused elementwise functions (bias-dropout-add, bias-GELU, ...)
in torch.compile, and on a CPU each new process traced and compiled them again at start-up, about
5 CPU seconds per rank, most of a small multi-process test. What the tests compare (a layout against
its one-process reference, our run against the stock one) runs the same eager functions on both sides;
GPU runs compile as before.

benchmarks/ and tools/ are on the path: their scripts import their siblings (bench.py, fuzz.py,
run_samples.py; planner_fit.py) as they do when run, and so do the tests of those modules.

The user's kernel checks table (models/kernel_policy.py) is none in the tests' processes: the tests
judge the shipped table, whatever a check recorded on this machine."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
os.environ["MEGATRON_HETERO_KERNEL_CHECKS"] = os.devnull
for folder in ("benchmarks", "tools"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / folder))


def pytest_configure(config):
    config.addinivalue_line("markers", "families: the VLM families' full layout matrix (make test-families)")


@pytest.fixture
def one_rank():
    """torch's fake process group of this process alone (megatron-core's layers and losses ask their
    groups' sizes and reduce over them); torch imported here, after the environment above is set."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
