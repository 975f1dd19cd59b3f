"""Faults during training fail fast with a line that says what happened (issue 18): non-finite
gradients name their module; a dead rank ends every other rank, named with its phase."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ROOT / "examples" / "layouts"
FLAGS = ["--train-iters", "5", "--global-batch-size", "8", "--micro-batch-size", "2", "--log-interval", "1"]


def torchrun(args: list, env: dict | None = None, nproc: int = 2, timeout: int = 240) -> subprocess.CompletedProcess:
    """tests/fault_script.py (examples/pretrain_vlm.py with a fault injected) under torchrun."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), str(ROOT / "tests" / "fault_script.py"), *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


@pytest.mark.parametrize("layout", ["gpu2_colocated", "gpu2_non_colocated"])
def test_nan_gradients_name_the_module(layout):
    """NaN gradients in the vision encoder from iteration 3 (the loss stays finite): Megatron's
    --check-for-nan-in-loss-and-grad (on by default) reruns the step, finds it reproducible and stops
    every rank (exit code 16, no checkpoint without --save); the error names vision, never the LLM."""
    result = torchrun(["--hetero-layout", str(LAYOUTS / f"{layout}.yaml"), *FLAGS],
                      env=dict(HETERO_TEST_FAULT="nan-grad:vision:3"))
    assert result.returncode != 0
    out = result.stdout + result.stderr
    found = [line for line in out.splitlines() if "found NaN in the gradients of module" in line]
    assert found and all("module vision " in line for line in found), out[-3000:]
    assert "iteration        2/" in out and "iteration        3/" not in out  # stopped at the NaN
    assert "no --save given" in out and "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out
    assert "exitcode  : 16" in out  # the state machine's exit code (torchrun may end the other rank first)
