"""benchmarks/bench_mimo.py on 2 gloo processes, workload tiny in fp32: upstream MIMO's forward-backward
(colocated and non-colocated, encoder trained and frozen) gives ours (the megatron.training path of
bench_e2e) loss and every DDP main_grad on the same weights and batch, and its JSON line has
bench_e2e's keys, FLOPs and tokens."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_hetero.planner import BENCH_WORKLOADS, model_flops
from megatron_hetero.planner.presets import trainer_vocab_size
from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "benchmarks" / "bench_mimo.py"
CASES = [("colocated", False), ("colocated", True), ("non_colocated", False), ("non_colocated", True)]


def _load_tool():
    spec = importlib.util.spec_from_file_location("bench_mimo", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _first_step(trainer, forward_backward):
    """One forward-backward from the trainer's weights, as train_step runs it before its optimizer
    step: this rank's summed [loss, loss tokens] (None off the LLM's last stage) and the reduced
    gradients (DDP's main_grad) of every trained module it holds."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    from megatron_hetero.training.providers import forward_step

    while get_rerun_state_machine().should_run_forward_backward(trainer.batches):
        trainer.hetero.zero_grad_buffer()
        reports = forward_backward(forward_step_func=forward_step, data_iterator=trainer.batches,
                                   model=trainer.model, num_microbatches=get_num_microbatches(),
                                   seq_length=trainer.args.seq_length, micro_batch_size=trainer.args.micro_batch_size)
    loss = sum(r["lm loss"] for r in reports) if reports else None
    grads = {f"{name}.{p_name}": p.main_grad.clone() for name, m in trainer.hetero.run.modules.items()
             if m.ddp is not None for p_name, p in m.part.named_parameters()}
    return loss, grads


def _parity_and_record(rank, world_size, out):
    from bench import megatron_trainer

    import megatron_hetero.patches
    from megatron_hetero.schedules.forward_backward import forward_backward

    megatron_hetero.patches.apply()
    tool = _load_tool()
    w = BENCH_WORKLOADS["tiny"]
    for placement, frozen in CASES:
        layout_file = str(ROOT / "examples" / "layouts" / tool.LAYOUTS[placement, frozen])
        with megatron_trainer(w, layout_file, bf16=False) as trainer:
            upstream = tool.UpstreamMimo(trainer)
            (loss, grads), (up_loss, up_grads) = (_first_step(trainer, fb)
                                                  for fb in (forward_backward, upstream.forward_backward))
            upstream.destroy()
        case = f"{placement} frozen={frozen} rank {rank}"
        assert (loss is None) == (up_loss is None), case
        if loss is not None:
            torch.testing.assert_close(up_loss, loss, rtol=1e-6, atol=0, msg=case)
        assert up_grads.keys() == grads.keys() and (frozen or grads), case
        for name, g in grads.items():
            torch.testing.assert_close(up_grads[name], g, rtol=1e-5, atol=1e-7, msg=f"{case}: {name}")
    tool.run(tool.parse_args(["--workload", "tiny", "--fp32", "--warmup", "0", "--steps", "1", "--out", out]))


def test_upstream_mimo_matches_ours_and_bench_e2e(tmp_path):
    out = str(tmp_path / "merged.jsonl")
    run_distributed(_parity_and_record, 2, out)
    # bench_e2e's own line for the same workload and layout, into the same file.
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(ROOT / "benchmarks" / "bench_e2e.py"), "--workload", "tiny", "--hetero-layout",
                    str(ROOT / "examples" / "layouts" / "gpu2_colocated.yaml"), "--fp32", "--warmup", "0",
                    "--steps", "1", "--out", out], check=True, cwd=ROOT, env=env, capture_output=True)
    mimo, ours = (json.loads(line) for line in Path(out).read_text().splitlines())
    assert mimo["layout"] == "upstream_mimo_colocated" and ours["layout"] == "gpu2_colocated"
    assert mimo.keys() == ours.keys() and mimo["phases"].keys() == ours["phases"].keys()
    assert all(v > 0 for v in mimo["phases"].values()), mimo["phases"]
    # Each step's loss, from the first (here the one timed step): the same model, weights and batch.
    assert len(ours["losses"]) == 1 and mimo["losses"] == pytest.approx(ours["losses"], rel=1e-6, abs=0)
    # Each module's attention kernel, as the start-up line says it (CPUs: SDPA, and why).
    w = BENCH_WORKLOADS["tiny"]
    assert ours["attention"] == {"vision": f"sdpa (head dim {w.enc_hidden // w.enc_heads}: no GPU)",
                                 "llm": f"sdpa (head dim {w.hidden // w.heads}: no GPU)"}

    flops = model_flops(w, trainer_vocab_size(), frozen_encoder=False)
    for record in (mimo, ours):
        assert record["tokens_per_s"] * record["step_s"] == pytest.approx(w.global_batch * w.seq_length)
        gpu_seconds = record["step_s"] * record["gpus"]
        assert record["tflops_per_gpu"] * 1e12 * gpu_seconds == pytest.approx(sum(flops.values()))
        assert record["encoder_flops_share"] == pytest.approx(1 - flops["llm"] / sum(flops.values()))
    table = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_e2e.py"), "--report", out], check=True,
                           cwd=ROOT, env=env, capture_output=True, text=True).stdout
    assert "| tiny | 2 | upstream_mimo_colocated | 2 |" in table and "| tiny | 2 | gpu2_colocated | 2 |" in table
    assert "| vision sdpa, llm sdpa |" in table
