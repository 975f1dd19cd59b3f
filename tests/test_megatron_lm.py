"""Megatron-LM's own pretrain_vlm.py, unchanged, through `python -m megatron_hetero.launch` on CPUs
(gloo, fp32): heterogeneous layouts train as the stock 1-process run of the same script does, and bad
input stops the run with one `error:` line and exit code 2."""

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import MEGATRON_LM_SCRIPT as SCRIPT
from tests.distributed import _free_port, run_python
from tests.test_pretrain_errors import DEMO as EXAMPLE_LAYOUT
from tests.test_pretrain_errors import _run as run_example

if not SCRIPT.is_file():
    pytest.skip(f"Megatron-LM's scripts not found ({SCRIPT}): put a Megatron-LM checkout (branch core_r0.19.0) "
                f"beside the repository (shared/megatron-lm) or name one in MEGATRON_LM_DIR", allow_module_level=True)

ITERATIONS = 10
FLAGS = f"""--encoder-num-layers 2 --decoder-num-layers 2 --hidden-size 64 --num-attention-heads 4
    --seq-length 64 --decoder-seq-length 96 --max-position-embeddings 128 --img-h 32 --img-w 32 --patch-dim 8
    --micro-batch-size 2 --global-batch-size 12 --train-iters {ITERATIONS} --eval-interval 1000 --eval-iters 0
    --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --make-vocab-size-divisible-by 32
    --transformer-impl local --use-cpu-initialization --num-workers 0 --log-interval 1 --seed 1234
    --ckpt-format torch --attention-dropout 0 --hidden-dropout 0""".split()
LAUNCH = [sys.executable, "-m", "megatron_hetero.launch", str(SCRIPT), *FLAGS]
ENV = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
TIMEOUT = 400  # seconds; a run takes 15-25 s on 2 idle cores

COLOCATED = """placement: colocated
modules:
  vision: {role: encoder, tp: 1, dp: 4}
  llm: {role: llm, tp: 2, dp: 2}
"""
NON_COLOCATED = """placement: non_colocated
modules:
  vision: {role: encoder, ranks: 0-0}
  llm: {role: llm, dp: 3, ranks: 1-3}
"""
LLM_PP2 = """placement: colocated
modules:
  vision: {role: encoder, tp: 1, dp: 4}
  llm: {role: llm, tp: 1, dp: 2, pp: 2}
"""
FROZEN_ENCODER = """placement: colocated
modules:
  vision: {role: encoder, tp: 1, dp: 4, freeze: true}
  llm: {role: llm, tp: 2, dp: 2}
"""
SINGLE_RANK = """placement: colocated
modules:
  vision: {role: encoder}
  llm: {role: llm}
"""


def _layout(directory: Path, text: str) -> str:
    path = directory / "layout.yaml"
    path.write_text(text)
    return str(path)


def _history(directory: Path) -> dict[str, list[float]]:
    """Per iteration, Megatron's lm loss and grad norm as its training_log receives them, all digits
    (--metrics-file; Megatron's printed line has 3 decimals of the norm)."""
    records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, ITERATIONS + 1)), records
    return {"lm loss": [r["loss"] for r in records], "grad norm": [r["grad_norm"] for r in records]}


def _train(directory: Path, nproc: int, *flags: str) -> dict[str, list[float]]:
    """pretrain_vlm.py through torchrun (--standalone: a free port) and the launcher; its history.
    Output goes to files in `directory`; past TIMEOUT the whole process group is killed."""
    out, err = directory / "stdout", directory / "stderr"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
             *LAUNCH[1:], "--metrics-file", str(directory / "metrics.jsonl"), *flags],
            cwd=directory, env=ENV, stdout=stdout, stderr=stderr, start_new_session=True)
        try:
            code = proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = f"timeout after {TIMEOUT} s"
    assert code == 0, f"{code}\n{out.read_text()[-3000:]}\n{err.read_text()[-3000:]}"
    assert re.search(rf"iteration\s+{ITERATIONS}/\s*{ITERATIONS} \|.* lm loss: ", out.read_text())
    return _history(directory)


def _assert_trains(history: dict[str, list[float]]) -> None:
    values = history["lm loss"] + history["grad norm"]
    assert all(math.isfinite(v) for v in values), history
    assert history["lm loss"][-1] < history["lm loss"][0], history


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    """The reference: the stock 1-process run, through the launcher without --hetero-layout."""
    return _train(tmp_path_factory.mktemp("stock"), 1)


def test_stock_run_trains(stock):
    """The launcher alone (CPU patches, no layout) lets Megatron's script train: finite, loss falls."""
    _assert_trains(stock)


@pytest.mark.parametrize("nproc, layout", [
    (4, COLOCATED),  # vision TP1/DP4 -> LLM TP2/DP2 on the same 4 ranks
    (4, NON_COLOCATED),  # vision on rank 0 -> LLM TP1/DP3 on ranks 1-3
    (1, SINGLE_RANK),
], ids=["colocated_vdp4_ltp2dp2", "non_colocated_v1_ldp3", "single_rank"])
def test_layout_matches_stock(stock, tmp_path, nproc, layout):
    """Per iteration, lm loss and grad norm equal the stock 1-process run's within 1e-4 relative."""
    history = _train(tmp_path, nproc, "--hetero-layout", _layout(tmp_path, layout))
    for metric, reference in stock.items():
        assert history[metric] == pytest.approx(reference, rel=1e-4), metric


def test_llm_pipeline_trains(tmp_path):
    """Vision TP1/DP4 -> LLM DP2/PP2 trains: finite, falling loss. (Megatron seeds each pipeline stage
    differently, so no equality with 1 process.)"""
    _assert_trains(_train(tmp_path, 4, "--hetero-layout", _layout(tmp_path, LLM_PP2)))


def test_frozen_encoder_trains(stock, tmp_path):
    """A frozen vision encoder (freeze: true) under vision TP1/DP4 -> LLM TP2/DP2: iteration 1's loss
    is the stock run's (same weights, same forward), its gradient norm smaller (no encoder gradients);
    finite, falling loss."""
    history = _train(tmp_path, 4, "--hetero-layout", _layout(tmp_path, FROZEN_ENCODER))
    _assert_trains(history)
    assert history["lm loss"][0] == pytest.approx(stock["lm loss"][0], rel=1e-6)
    assert history["grad norm"][0] < stock["grad norm"][0] * (1 - 1e-4)


def _launch(directory: Path, nproc: int, *flags: str, overrides: dict | None = None) -> tuple[list[int], list[str]]:
    """The launcher in `nproc` plain processes (RANK/WORLD_SIZE env, no torchrun), with `overrides` in
    their environment: exit codes, stderrs."""
    env = dict(ENV, **(overrides or {}), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(nproc))
    procs = []
    try:
        for rank in range(nproc):
            with open(directory / f"stderr{rank}", "w") as stderr:  # files: no rank blocks on a pipe
                procs.append(subprocess.Popen([*LAUNCH, *flags], cwd=directory, stdout=subprocess.DEVNULL,
                                              stderr=stderr, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank))))
        codes = [proc.wait(timeout=TIMEOUT) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return codes, [(directory / f"stderr{rank}").read_text() for rank in range(nproc)]


TORCH_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:")  # torch's own logger (e.g. "No CUDA runtime is found")


@pytest.mark.parametrize("nproc, layout, flags, expected", [
    (1, None, ["--hetero-layout", "no_such.yaml"], ["no_such.yaml", "cannot read layout file"]),
    (1, COLOCATED, [], ["module vision: tp*cp*dp*pp = 4 but the world size is 1", "make the product 1"]),
    (1, SINGLE_RANK, ["--tensor-model-parallel-size", "4"],
     ["--tensor-model-parallel-size 4 conflicts with module llm's tp=1", "drop the flag"]),
    (1, "placement: colocated\nmodules:\n  vision: {role: encoder}\n  audio: {role: encoder}\n"
     "  llm: {role: llm}\nedges: [vision -> llm, audio -> llm]\n", [],
     ["one vision encoder", "2 encoders", "keep one"]),
    (2, "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 2}\n  llm: {role: llm, cp: 2}\n", [],
     ["module llm", "set cp: 1"]),
    (1, SINGLE_RANK, ["--bf16"], ["--bf16 needs GPUs", "drop --bf16 on CPU"]),
], ids=["missing_file", "sizes_vs_world", "tp_flag_vs_layout", "llava_two_encoders", "llava_llm_cp2", "bf16_cpu"])
def test_bad_input_is_one_line(tmp_path, nproc, layout, flags, expected):
    """Every rank exits 2; stderr holds one `error:` line (rank 0's) naming the field or flag and the
    fix, and nothing else but torch's own log lines: no traceback."""
    if layout is not None:
        flags = ["--hetero-layout", _layout(tmp_path, layout), *flags]
    codes, stderrs = _launch(tmp_path, nproc, *flags)
    assert codes == [2] * nproc, stderrs
    lines = [line for text in stderrs for line in text.splitlines() if line and not TORCH_LOG.match(line)]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderrs
    assert all(part in lines[0] for part in expected), lines[0]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line and not TORCH_LOG.match(line)]


@pytest.mark.parametrize("flags, overrides, expected", [
    (["--attention-backend", "flash"], {},
     "module llm: --attention-backend flash: head dim 16: no GPU; or use --attention-backend auto"),
    ([], {"MEGATRON_HETERO_NORM_KERNEL": "apex"}, "MEGATRON_HETERO_NORM_KERNEL=apex: use one of auto, torch, quack"),
], ids=["flash_backend_cpu", "malformed_override"])
def test_bad_kernel_choice_is_the_same_line_from_both_scripts(tmp_path, monkeypatch, flags, overrides, expected):
    """Megatron-LM's pretrain_vlm.py (through the launcher) and the example stop at argument validation
    with the same one line (the kernel policy's); both LLMs have head dim 64 / 4 heads = 16."""
    if torch.cuda.is_available():
        pytest.skip("the flash case's line is CPU's")
    codes, stderrs = _launch(tmp_path, 1, "--hetero-layout", _layout(tmp_path, SINGLE_RANK), *flags,
                             overrides=overrides)
    for name, value in overrides.items():
        monkeypatch.setenv(name, value)
    example = run_example(["--hetero-layout", EXAMPLE_LAYOUT, *flags], tmp_path)
    assert codes == [2] and example.returncode == 2, (stderrs, example.stderr)
    assert _error_lines(stderrs[0]) == _error_lines(example.stderr) == [f"error: {expected}"], \
        (stderrs, example.stderr)


def test_save_without_interval_is_one_line_from_both_scripts(tmp_path):
    """Megatron's bare assertion for --save without --save-interval is one line naming the fix, from
    Megatron-LM's pretrain_vlm.py through the launcher (without a layout: stock runs get it too) and
    from the example; each process stops at argument validation."""
    env = dict(ENV, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    launched = run_python([*LAUNCH[1:], "--save", "ckpt"], env=env, cwd=tmp_path, timeout=TIMEOUT)
    example = run_example(["--hetero-layout", EXAMPLE_LAYOUT, "--save", "ckpt"], tmp_path)
    expected = ["error: --save ckpt needs --save-interval N (> 0), the iterations between checkpoints; add it, "
                "or drop --save"]
    assert launched.returncode == example.returncode == 2, (launched.stderr, example.stderr)
    assert _error_lines(launched.stderr) == _error_lines(example.stderr) == expected, (launched.stderr, example.stderr)
