"""Faults during training fail fast with a line that says what happened (issue 18): non-finite
gradients name their module; a dead rank ends every other rank, named with its phase."""

import dataclasses
import io
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed import _free_port

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ROOT / "examples" / "layouts"
FLAGS = ["--train-iters", "5", "--global-batch-size", "8", "--micro-batch-size", "2", "--log-interval", "1"]


def torchrun(args: list, env: dict | None = None, nproc: int = 2, timeout: int = 600) -> subprocess.CompletedProcess:
    """tests/fault_script.py (examples/pretrain_vlm.py with a fault injected) under torchrun."""
    # Unbuffered, as CI runs: print then writes a line's newline separately, and the ranks share stderr.
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **(env or {}))
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


def _direct(args: list, env: dict, nproc: int) -> list[subprocess.Popen]:
    """The script in `nproc` processes started directly (no torchrun: srun-style launches)."""
    port = _free_port()
    return [subprocess.Popen([sys.executable, str(ROOT / "tests" / "fault_script.py"), *args],
                             env=dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT),
                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), LOCAL_RANK=str(r),
                                      WORLD_SIZE=str(nproc), **env),
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(nproc)]


def _left_running(mark: str) -> list[int]:
    """Processes whose environment carries `mark`."""
    left = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark.encode() in (entry / "environ").read_bytes():
                left.append(int(entry.name))
        except OSError:
            pass
    return left


@pytest.mark.parametrize("layout, module, rank, phase, launcher", [
    ("demo_colocated", "llm", 2, "the LLM pipeline", "torchrun"),
    ("non_colocated_2_2", "vision", 1, "an encoder's forward", "direct"),
])
def test_dead_rank_stops_every_rank(tmp_path, layout, module, rank, phase, launcher):
    """Rank `rank` is SIGKILLed in `module`'s forward at iteration 3 of 4 processes: every other rank
    exits non-zero within a bounded time, with a line naming the lost rank and the phase its last
    heartbeat was in; no process is left. Under torchrun (which ends the other workers with SIGTERM)
    and started directly (each rank finds out itself)."""
    mark = f"HETERO_TEST_MARK_{os.getpid()}_{tmp_path.name}"  # unique also beside other checkouts' test runs
    killed = tmp_path / "killed"
    env = {"HETERO_TEST_FAULT": f"kill:{module}:3:{rank}", "HETERO_TEST_KILLED": str(killed), mark: "1"}
    args = ["--hetero-layout", str(LAYOUTS / f"{layout}.yaml"), *FLAGS, "--hetero-heartbeat-interval", "0.5"]
    if launcher == "torchrun":
        result = torchrun(args, env, nproc=4)
        out, codes = result.stdout + result.stderr, [result.returncode]
    else:
        procs = _direct(args, env, 4)
        try:
            outs = [p.communicate(timeout=600)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
        out, codes = "\n".join(outs), [p.returncode for p in procs]
        assert codes[rank] == -signal.SIGKILL and all(c != 0 for c in codes), codes
    ended = time.time()
    assert all(c != 0 for c in codes), codes
    assert ended - float(killed.read_text()) < 60, "the other ranks took too long to stop"
    lines = [line for line in out.splitlines() if line.startswith("error: rank ")]
    survivors = {int(line.split()[2]) for line in lines}
    assert survivors == set(range(4)) - {rank}, out[-4000:]
    assert all(f"rank {rank} (last heard in {phase} at iteration 3)" in line for line in lines), lines
    assert "Traceback" not in "\n".join(line for line in out.splitlines() if line.startswith("[rank"))
    assert not _left_running(mark)


def test_out_of_memory_is_one_line_per_rank():
    """Rank 1 runs out of GPU memory in the vision encoder's forward at iteration 2: it says so in one
    line (module, phase, the allocation, the flags that use less memory); the other rank stops with one
    line naming it; no traceback."""
    result = torchrun(["--hetero-layout", str(LAYOUTS / "gpu2_colocated.yaml"), *FLAGS],
                      env=dict(HETERO_TEST_FAULT="oom:vision:2:1"))
    out = result.stdout + result.stderr
    assert result.returncode != 0
    lines = [line for line in out.splitlines() if line.startswith("error: ")]
    assert sorted(int(line.split()[2]) for line in lines) == [0, 1], out[-4000:]
    own = next(line for line in lines if line.startswith("error: rank 1 "))
    for part in ("out of GPU memory in module vision's forward", "tried to allocate 2.00 GiB",
                 "to use less memory: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (6.5 GiB sat reserved",
                 "--recompute-granularity full", "--use-distributed-optimizer", "--micro-batch-size 1"):
        assert part in own, own
    other = next(line for line in lines if line.startswith("error: rank 0 "))
    assert "out of GPU memory in module vision's forward" in other and "reported by rank 1" in other, other
    ranks_output = "\n".join(line for line in out.splitlines() if line.startswith("[rank"))
    assert "Traceback" not in ranks_output and "OutOfMemoryError" not in out, out[-4000:]  # torchrun's own aside


def test_out_of_memory_names_the_planners_answer():
    """For a planner preset (bench_e2e's workloads) the line adds the planner's best layout that fits."""
    from bench import planner_answer

    from megatron_hetero.planner import BENCH_WORKLOADS
    from tests.tool_cli import run_tool

    answer = planner_answer(dataclasses.replace(BENCH_WORKLOADS["W1"], layers=8), 2, 141.0)  # bench_e2e's 8 layers
    assert answer.startswith("the planner's best for W1 on 2 GPUs: ") and "GB/GPU predicted" in answer, answer
    assert "megatron-hetero plan --workload W1 --as-trained --llm-layers 8 --global-batch-size 4 " \
           "--micro-batch-size 2 --gpus 2 --gpu-memory-gb 141 " in answer
    # The command it names plans the same workload with the calibration measured on the run's GPU model: its
    # best and its memory are the answer's (W4 on one H100's 85.04 GB: the preset as planned, 32K vocabulary
    # and its own MLP widths, answered otherwise).
    for gpu in ("h100", "h200"):
        answer = planner_answer(dataclasses.replace(BENCH_WORKLOADS["W4"], layers=4, micro_batch=2), 1, 85.04, gpu)
        layout = answer.split(": ", 1)[1].split(", micro batch")[0]
        assert answer.startswith("the planner's best for W4 on 1 GPU: ") and "recompute" in layout, answer
        command = answer.split("(megatron-hetero plan ")[1].removesuffix(" --write-yaml best.yaml)").split()
        assert command[-2:] == ["--gpu", gpu]
        out = run_tool("plan_layout", *command, "--top", "1").stdout
        best = out.split("best homogeneous: #1 ")[1]
        assert best.startswith(layout.removeprefix("homogeneous ") + " (mb 2)"), (answer, best)
        assert f"calibration: calibration_{gpu}_measured.json" in out
        gb = answer.split(" GB/GPU predicted")[0].rsplit(" ", 1)[1]
        assert f" {gb}\n" in out.split("best 1:")[1].split("\n\n")[0], (answer, out)
    assert "finds no layout of W1 that fits 2 GPUs of 1 GB" in planner_answer(BENCH_WORKLOADS["W1"], 2, 1.0)
    # W6 fits an 80 GB card only recomputed: the answer may recompute (it said "none fits" before).
    long = planner_answer(dataclasses.replace(BENCH_WORKLOADS["W6"], layers=12), 2, 85.0)
    assert long.startswith("the planner's best for W6 on 2 GPUs: ") and "recompute" in long, long


def test_fragmentation_hint_reads_torchs_message():
    """The allocator setting comes first only where more sat reserved but unallocated than the failed
    allocation asked for, and not where it is set already."""
    from megatron_hetero.runtime.failures import fragmentation_hint

    def message(tried, idle):
        return RuntimeError(f"CUDA out of memory. Tried to allocate {tried}. GPU 0 has a total capacity of 79.19 GiB "
                            f"of which 523.06 MiB is free. Of the allocated memory 64.60 GiB is allocated by PyTorch, "
                            f"and {idle} is reserved by PyTorch but unallocated.")

    assert fragmentation_hint(message("1024.00 MiB", "13.21 GiB"), environ={}) == (
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (13.2 GiB sat reserved but unallocated: fragmented)")
    assert fragmentation_hint(message("2.00 GiB", "1536.00 MiB"), environ={}) is None  # too little idle
    assert fragmentation_hint(message("20.00 MiB", "30.00 MiB"), environ={}) is not None
    assert fragmentation_hint(message("1024.00 MiB", "13.21 GiB"),
                              environ={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) is None
    assert fragmentation_hint(RuntimeError("CUDA out of memory."), environ={}) is None


def test_memory_outside_the_allocator_reads_torchs_message():
    """What the process held beyond PyTorch's allocated and cached memory (NCCL, the CUDA context)."""
    from megatron_hetero.runtime.failures import _usage, outside_allocator_gib

    error = RuntimeError("CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of 79.19 GiB "
                         "of which 301.06 MiB is free. Including non-PyTorch memory, this process has 78.89 GiB "
                         "memory in use. Of the allocated memory 68.20 GiB is allocated by PyTorch, and 512.00 MiB "
                         "is reserved by PyTorch but unallocated.")
    assert outside_allocator_gib(error) == pytest.approx(78.89 - 68.20 - 0.5)
    assert outside_allocator_gib(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB.")) is None
    assert "10.2 GiB held outside PyTorch's allocator" in _usage(error)


def test_report_line_is_one_write(monkeypatch):
    """The watchdog's line reaches stderr in one write with its newline, also when Python runs
    unbuffered, so lines several ranks report at once into a shared pipe never interleave. stderr is
    a datagram socket here: each write arrives as its own message."""
    from megatron_hetero.runtime.watchdog import write_line

    sender, receiver = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with sender, receiver:
        unbuffered = io.TextIOWrapper(io.FileIO(sender.fileno(), "w", closefd=False), write_through=True)
        monkeypatch.setattr(sys, "stderr", unbuffered)
        line = "error: rank 3 stopped in the LLM pipeline at iteration 3: lost rank 2 " + "x" * 300
        write_line(line)
        receiver.setblocking(False)
        messages = []
        while True:
            try:
                messages.append(receiver.recv(1 << 16))
            except BlockingIOError:
                break
    assert messages == [f"{line}\n".encode()]


def test_nccl_memory_tool_refuses_the_cpu_in_one_line():
    """benchmarks/gpu_nccl_memory.py measures GPU memory: without a GPU it says so in one line, exit 2."""
    from tests.tool_cli import run_tool

    result = run_tool("gpu_nccl_memory", "--hetero-layout", "examples/layouts/gpu2_colocated_sp.yaml")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == "error: gpu_nccl_memory.py measures GPU memory: run it on GPUs"
    assert "Traceback" not in result.stderr
