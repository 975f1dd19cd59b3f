"""End-to-end parity: multi-rank layouts reproduce a 1-rank run with the same seed and global batch."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_hetero.layout import load_layout
from megatron_hetero.training.args import build_parser
from megatron_hetero.training.full_state import full_tensors
from tests.distributed import run_distributed

STEPS = 5
LAYOUTS = Path(__file__).parent.parent / "examples" / "layouts"
FLAGS = ["--train-iters", str(STEPS), "--global-batch-size", "8", "--micro-batch-size", "2",
         "--lr", "1e-3", "--seed", "7", "--log-interval", "100"]


def _train_and_capture(rank, world_size, layout_file, out_dir):
    from megatron_hetero.training.trainer import train

    out = Path(out_dir)
    args = build_parser().parse_args(
        ["--hetero-layout", str(layout_file), "--metrics-file", str(out / "metrics.jsonl"), *FLAGS])
    layout = load_layout(args.hetero_layout, world_size)

    def capture(trainer, step, phase):
        # Gradients after the first backward; parameters after the last step.
        if (phase, step) not in (("grads", 0), ("params", STEPS - 1)):
            return
        for name, module in trainer.modules.items():
            coords = module.coords()
            tensors = full_tensors(module.model.module, module.groups.pgs.tp, grads=phase == "grads")
            if coords["tp"] == 0 and coords["dp"] == 0:
                torch.save(tensors, out / f"{name}_{phase}.pt")

    train(args, layout, torch.device("cpu"), on_step=capture)
    dist.barrier()


def _run(tmp_path, layout_name, world_size):
    out = tmp_path / layout_name
    out.mkdir()
    run_distributed(_train_and_capture, world_size, LAYOUTS / f"{layout_name}.yaml", str(out))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tensors = {f.stem: torch.load(f) for f in out.glob("*.pt")}
    return metrics, tensors


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ref"), "single", 1)


@pytest.mark.parametrize("layout_name", ["demo_colocated", "colocated_vtp2dp2_ltp1dp4"])
def test_layout_reproduces_one_rank(reference, tmp_path, layout_name):
    ref_metrics, ref_tensors = reference
    metrics, tensors = _run(tmp_path, layout_name, 4)
    assert len(metrics) == len(ref_metrics) == STEPS
    for got, want in zip(metrics, ref_metrics):
        for key in ("loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), (got["step"], key)
    assert tensors.keys() == ref_tensors.keys() == {"vision_grads", "llm_grads", "vision_params", "llm_params"}
    for kind, tol in (("grads", 1e-5), ("params", 1e-4)):
        for module in ("vision", "llm"):
            got, want = tensors[f"{module}_{kind}"], ref_tensors[f"{module}_{kind}"]
            assert got.keys() == want.keys()
            for name in want:
                # Relative to the tensor's scale: a constant factor (e.g. TP replicas summed) fails.
                scale = want[name].abs().max().item()
                torch.testing.assert_close(got[name], want[name], rtol=tol, atol=tol * scale,
                                           msg=f"{module} {kind} {name}")
