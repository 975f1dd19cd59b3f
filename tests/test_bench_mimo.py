"""tools/bench_mimo.py on 2 gloo processes, workload tiny in fp32: upstream MIMO's step (colocated
and non-colocated, encoder trained and frozen) gives our trainer's loss and gradients on the same
batch and weights, and its JSON line has bench_e2e's keys, FLOPs and tokens."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_hetero.planner import BENCH_WORKLOADS, model_flops
from megatron_hetero.training.bench import synthetic_batch, trainer_args, trainer_vocab_size
from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "bench_mimo.py"
CASES = [("colocated", False), ("colocated", True), ("non_colocated", False), ("non_colocated", True)]


def _load_tool():
    """bench_mimo as a module; it imports bench_e2e and bench_boundary from beside it, as a script does."""
    if str(TOOL.parent) not in sys.path:
        sys.path.insert(0, str(TOOL.parent))
    spec = importlib.util.spec_from_file_location("bench_mimo", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _grads(trainer) -> dict[str, torch.Tensor]:
    """This rank's reduced gradients (DDP's main_grad) of every trained module it holds."""
    return {f"{name}.{p_name}": p.main_grad.clone() for name, m in trainer.modules.items() if m.ddp is not None
            for p_name, p in m.net.named_parameters()}


def _parity_and_record(rank, world_size, out):
    from megatron_hetero.layout import load_layout
    from megatron_hetero.training.trainer import Trainer

    tool = _load_tool()
    cpu = torch.device("cpu")
    w = BENCH_WORKLOADS["tiny"]
    for placement, frozen in CASES:
        layout_file = str(ROOT / "examples" / "layouts" / tool.LAYOUTS[placement, frozen])
        layout, args = load_layout(layout_file, world_size), trainer_args(w, layout_file, bf16=False)
        ours = Trainer(args, layout, cpu)
        upstream = tool.MimoTrainer(args, layout, cpu)
        batch = synthetic_batch(w, ours.tokenizer)
        results = []
        for trainer in (ours, upstream):
            trainer.zero_grad()
            loss = trainer.train_step(batch)
            grads = _grads(trainer)
            trainer.optimizer.step(1e-3)
            trainer.zero_grad()
            results.append((loss, grads, trainer.train_step(batch)))
        (loss, grads, second), (up_loss, up_grads, up_second) = results
        case = f"{placement} frozen={frozen} rank {rank}"
        assert up_loss == pytest.approx(loss, rel=1e-6), case
        assert up_second == pytest.approx(second, rel=1e-6), case
        assert second < loss, case  # the step trained something
        assert up_grads.keys() == grads.keys() and (frozen or grads), case
        for name, g in grads.items():
            torch.testing.assert_close(up_grads[name], g, rtol=1e-5, atol=1e-7, msg=f"{case}: {name}")
        upstream.mimo.destroy()
    tool.run(tool.parse_args(["--workload", "tiny", "--fp32", "--warmup", "0", "--steps", "1", "--out", out]))


def test_upstream_mimo_matches_our_trainer_and_bench_e2e(tmp_path):
    out = str(tmp_path / "merged.jsonl")
    run_distributed(_parity_and_record, 2, out)
    # bench_e2e's own line for the same workload and layout, into the same file.
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(ROOT / "tools" / "bench_e2e.py"), "--workload", "tiny", "--hetero-layout",
                    str(ROOT / "examples" / "layouts" / "gpu2_colocated.yaml"), "--fp32", "--warmup", "0",
                    "--steps", "1", "--out", out], check=True, cwd=ROOT, env=env, capture_output=True)
    mimo, ours = (json.loads(line) for line in Path(out).read_text().splitlines())
    assert mimo["layout"] == "upstream_mimo_colocated" and ours["layout"] == "gpu2_colocated"
    assert mimo.keys() == ours.keys() and mimo["phases"].keys() == ours["phases"].keys()
    assert all(v > 0 for v in mimo["phases"].values()), mimo["phases"]

    w = BENCH_WORKLOADS["tiny"]
    flops = model_flops(w, trainer_vocab_size(), frozen_encoder=False)
    for record in (mimo, ours):
        assert record["tokens_per_s"] * record["step_s"] == pytest.approx(w.global_batch * w.seq_length)
        gpu_seconds = record["step_s"] * record["gpus"]
        assert record["tflops_per_gpu"] * 1e12 * gpu_seconds == pytest.approx(sum(flops.values()))
        assert record["encoder_flops_share"] == pytest.approx(flops["encoder"] / sum(flops.values()))
    table = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_e2e.py"), "--report", out], check=True,
                           cwd=ROOT, env=env, capture_output=True, text=True).stdout
    assert "| tiny | 2 | upstream_mimo_colocated | 2 |" in table and "| tiny | 2 | gpu2_colocated | 2 |" in table
