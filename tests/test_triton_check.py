"""`megatron-hetero kernels check triton` (cli/checks/triton.py): its measuring on CPU, our kernels on
Triton's interpreter against the eager torch paths, passes every kind at small shapes and fails a kernel
with a wrong gradient; the checks' GPU time (cli/checks/common.py gpu_ms) sums the GPU's work alone; on a
GPU the command itself runs (--quick) and passes, each path's GPU time within its calls' time."""

import json
import subprocess
import sys
from types import SimpleNamespace

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
    records = [json.loads(line) for line in (tmp_path / "triton_check.jsonl").read_text().splitlines()]
    assert len(records) == 10
    for record in records:
        for path in ("torch", "triton"):  # the GPU's work of a call fits in the call's time (some slack)
            assert 0 < record[f"{path}_gpu_ms"] <= 1.2 * record[f"{path}_fwd_bwd_ms"], record


def test_gpu_time_is_the_gpus_work_alone(monkeypatch):
    """Per call: the device time of kernels, copies and fills, not of annotated ranges' device-side spans
    or host ops, after one warm-up call."""
    from megatron_hetero.cli.checks import common

    cuda, cpu = SimpleNamespace(name="CUDA"), SimpleNamespace(name="CPU")
    events = [SimpleNamespace(device_type=cuda, self_device_time_total=us, is_user_annotation=annotation)
              for us, annotation in ((100, False), (300, False), (5000, True))]
    events.append(SimpleNamespace(device_type=cpu, self_device_time_total=0))

    class Profile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return SimpleNamespace(events=lambda: events)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    called = []
    assert common.gpu_ms(lambda: called.append(1), 2) == 0.2  # 400 us over 2 calls
    assert len(called) == 3
