"""End-to-end parity, the acceptance matrix: every layout reproduces a 1-process run with the same
seed and global batch over 10 steps (per-step loss and gradient norm within 1e-4 relative, every
gradient after the first backward within 1e-4 of its scale, parameters after the 10 steps within
1e-3), whatever its placement, TP/CP/SP/DP/PP per module, frozen encoders or number of encoders."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_hetero.layout import load_layout
from megatron_hetero.training.args import build_parser
from megatron_hetero.training.full_state import full_tensors
from tests.distributed import run_distributed

STEPS = 10
LAYOUTS = Path(__file__).parent.parent / "examples" / "layouts"
FLAGS = ["--train-iters", str(STEPS), "--lr", "1e-3", "--seed", "7", "--log-interval", "100"]
TWO_ENCODERS = ["--seq-length", "40"]  # image and clip tokens before the caption

# layout: (world size, the 1-process reference layout, flags of both runs)
CASES = {
    # colocated
    "demo_colocated": (4, "single", []),  # vision TP1/DP4 -> LLM TP2/DP2
    "colocated_vtp2dp2_ltp1dp4": (4, "single", []),
    "colocated_vdp4_ltp2cp2sp": (4, "single", ["--micro-batch-size", "4"]),
    "colocated_vdp2_lpp2": (2, "single", []),
    "colocated_vtp2dp2_lcp2dp2": (4, "single", []),
    "colocated_vdp4_lcp2pp2": (4, "single", ["--micro-batch-size", "4"]),
    "demo_colocated_frozen": (4, "single_frozen", []),
    "colocated_two_encoders": (4, "single_two_encoders", TWO_ENCODERS),
    # non-colocated
    "non_colocated_1_3": (4, "single", ["--global-batch-size", "6"]),
    "non_colocated_2_2": (4, "single", []),
    "non_colocated_vpp2_lpp2": (4, "single", []),
    "non_colocated_vdp2_ltp2pp2": (6, "single", []),
    "non_colocated_2_2_frozen": (4, "single_frozen", []),
    "non_colocated_two_encoders": (4, "single_two_encoders", TWO_ENCODERS),
}


def _train_and_capture(rank, world_size, layout_file, out_dir, flags):
    from megatron_hetero.training.trainer import train

    out = Path(out_dir)
    args = build_parser().parse_args(
        ["--hetero-layout", str(layout_file), "--metrics-file", str(out / "metrics.jsonl"),
         "--global-batch-size", "8", "--micro-batch-size", "2", *FLAGS, *flags])
    layout = load_layout(args.hetero_layout, world_size)

    def capture(trainer, step, phase):
        # Parameters and gradients after the first backward; parameters after the last step.
        if (phase, step) == ("grads", 0):
            kinds = [("init", False), ("grads", True)]
        elif (phase, step) == ("params", STEPS - 1):
            kinds = [("params", False)]
        else:
            return
        for name, module in trainer.modules.items():
            if module.net is None:
                continue  # non-colocated: held elsewhere
            coords = module.coords()
            for kind, grads in kinds:
                if grads and module.ddp is None:
                    continue  # frozen: no gradients
                tensors = full_tensors(module.net, module.groups.pgs.tp, grads=grads)
                if coords["tp"] == coords["cp"] == coords["dp"] == 0:  # one copy per stage
                    torch.save(tensors, out / f"{name}_{kind}_pp{coords['pp']}.pt")

    train(args, layout, torch.device("cpu"), on_step=capture)
    dist.barrier()


def _run(out: Path, layout_file: Path, world_size: int, flags: list[str]):
    out.mkdir()
    run_distributed(_train_and_capture, world_size, layout_file, str(out), flags)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tensors = {}
    for f in sorted(out.glob("*.pt")):  # merge the pipeline stages of each module
        tensors.setdefault(f.stem.rsplit("_pp", 1)[0], {}).update(torch.load(f))
    return metrics, tensors


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """1-process runs, made once per (reference layout, flags)."""
    cache = {}

    def reference(name: str, flags: list[str]):
        key = (name, tuple(flags))
        if key not in cache:
            tmp = tmp_path_factory.mktemp(name)
            layout = LAYOUTS / f"{name}.yaml"
            if name == "single_frozen":
                layout = tmp / "single_frozen.yaml"
                layout.write_text((LAYOUTS / "single.yaml").read_text()
                                  .replace("role: encoder", "role: encoder\n    freeze: true"))
            cache[key] = _run(tmp / "run", layout, 1, flags)
        return cache[key]

    return reference


def _assert_reproduces(run, reference):
    (metrics, tensors), (ref_metrics, ref_tensors) = run, reference
    assert len(metrics) == len(ref_metrics) == STEPS
    for got, want in zip(metrics, ref_metrics):
        for key in ("loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-4), (got["step"], key)
    assert tensors.keys() == ref_tensors.keys()
    for key, want_tensors in ref_tensors.items():
        tol = 1e-3 if key.endswith("params") else 1e-4
        got_tensors = tensors[key]
        assert got_tensors.keys() == want_tensors.keys(), key
        for name, want in want_tensors.items():
            # Relative to the tensor's scale: a constant factor (e.g. TP replicas summed) fails.
            scale = want.abs().max().item()
            torch.testing.assert_close(got_tensors[name], want, rtol=tol, atol=tol * scale,
                                       msg=f"{key} {name}")


@pytest.mark.parametrize("layout_name", list(CASES))
def test_layout_reproduces_one_process(references, tmp_path, layout_name):
    world_size, reference_name, flags = CASES[layout_name]
    run = _run(tmp_path / layout_name, LAYOUTS / f"{layout_name}.yaml", world_size, flags)
    reference = references(reference_name, flags)
    _assert_reproduces(run, reference)
    layout = load_layout(LAYOUTS / f"{layout_name}.yaml", world_size)
    for module in layout.modules:
        kinds = ("init", "params") if module.freeze else ("init", "grads", "params")
        assert {f"{module.name}_{k}" for k in kinds} <= run[1].keys()
        if module.freeze:  # bit for bit unchanged, no gradients
            assert f"{module.name}_grads" not in run[1]
            for name, init in run[1][f"{module.name}_init"].items():
                assert torch.equal(run[1][f"{module.name}_params"][name], init), name
    if reference_name == "single_frozen":  # the frozen reference really differs from training vision
        assert reference[0][-1]["loss"] != references("single", flags)[0][-1]["loss"]
