"""`megatron-hetero kernels check triton` (cli/checks/triton.py): its measuring on CPU, our kernels on
Triton's interpreter against the eager torch paths, passes every kind at small shapes and fails a kernel
with a wrong gradient; on a GPU the command itself runs (--quick) and passes."""

import subprocess
import sys

import pytest
import torch

from megatron_hetero.models import residual_add
from tests.interpreter import run_on_interpreter


@pytest.mark.skipif(not residual_add.HAVE_TRITON, reason="needs Triton")
def test_the_check_passes_our_kernels_and_fails_a_wrong_gradient():
    results = run_on_interpreter("triton_check_script")
    wrong = results.pop("wrong bias gradient")
    assert len(results) == 8 and all(ok and error < 0.02 for ok, error in results.values()), results
    assert wrong[0] is False and wrong[1] > 0.5, wrong


@pytest.mark.skipif(not (torch.cuda.is_available() and residual_add.HAVE_TRITON), reason="needs a GPU with Triton")
def test_on_a_gpu_the_command_passes(tmp_path):
    done = subprocess.run([sys.executable, "-m", "megatron_hetero.cli", "kernels", "check", "triton", "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "PASS" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert len((tmp_path / "triton_check.jsonl").read_text().splitlines()) == 10
