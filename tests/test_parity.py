"""End-to-end parity: multi-rank layouts reproduce a 1-rank run with the same seed and global batch."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_hetero.layout import load_layout
from megatron_hetero.training.args import build_parser
from megatron_hetero.training.full_state import full_tensors, gather_grad_shards
from tests.distributed import run_distributed

STEPS = 5
LAYOUTS = Path(__file__).parent.parent / "examples" / "layouts"
FLAGS = ["--train-iters", str(STEPS), "--micro-batch-size", "2", "--lr", "1e-3", "--seed", "7",
         "--log-interval", "100"]


def _train_and_capture(rank, world_size, layout_file, out_dir, global_batch, flags=()):
    from megatron_hetero.training.trainer import train

    out = Path(out_dir)
    args = build_parser().parse_args(
        ["--hetero-layout", str(layout_file), "--metrics-file", str(out / "metrics.jsonl"),
         "--global-batch-size", str(global_batch), *FLAGS, *flags])
    layout = load_layout(args.hetero_layout, world_size)

    def capture(trainer, step, phase):
        # Parameters and gradients after the first backward; parameters and the size of this rank's
        # optimizer state after the last step.
        if (phase, step) == ("grads", 0):
            kinds = [("init", False), ("grads", True)]
        elif (phase, step) == ("params", STEPS - 1):
            kinds = [("params", False)]
            _save_state_sizes(trainer, out / f"state_rank{rank}.json")
        else:
            return
        for name, module in trainer.modules.items():
            if module.net is None:
                continue  # non-colocated: held elsewhere
            for kind, grads in kinds:
                if grads and module.ddp is None:
                    continue  # frozen: no gradients
                if grads:  # distributed optimizer: each DP rank reduced its own shard only
                    gather_grad_shards(module.ddp)
                tensors = full_tensors(module.net, module.groups.pgs.tp, grads=grads)
                coords = module.coords()
                if coords["tp"] == 0 and coords["dp"] == 0:
                    torch.save(tensors, out / f"{name}_{kind}.pt")

    train(args, layout, torch.device("cpu"), on_step=capture)
    dist.barrier()


def _save_state_sizes(trainer, path):
    """Per module held here: AdamW state elements (exp_avg, exp_avg_sq) on this rank, the replicated
    state's size (two per parameter of this rank's stage), and the DP replica it belongs to."""
    sizes = {}
    for m in trainer.optimizer.modules:
        if m.optimizer is None:
            continue
        module = trainer.modules[m.name]
        coords = module.coords()
        sizes[m.name] = dict(
            state=sum(t.numel() for s in m.optimizer.state.values() for k, t in s.items() if k != "step"),
            replicated=2 * sum(p.numel() for p in module.net.parameters() if p.requires_grad),
            dp=module.layout.dp * module.layout.cp, replica=[coords["tp"], coords["pp"]])
    path.write_text(json.dumps(sizes))


def _run(tmp_path, layout_name, world_size, layout_file=None, global_batch=8, flags=()):
    out = tmp_path / layout_name
    out.mkdir()
    run_distributed(_train_and_capture, world_size, layout_file or LAYOUTS / f"{layout_name}.yaml",
                    str(out), global_batch, flags)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tensors = {f.stem: torch.load(f) for f in out.glob("*.pt")}
    return metrics, tensors


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ref"), "single", 1)


@pytest.fixture(scope="module")
def frozen_reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("frozen_ref")
    layout = tmp / "single_frozen.yaml"
    layout.write_text((LAYOUTS / "single.yaml").read_text().replace("role: encoder", "role: encoder\n    freeze: true"))
    return _run(tmp, "single_frozen", 1, layout)


def _assert_reproduces(run, reference):
    (metrics, tensors), (ref_metrics, ref_tensors) = run, reference
    assert len(metrics) == len(ref_metrics) == STEPS
    for got, want in zip(metrics, ref_metrics):
        for key in ("loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), (got["step"], key)
    assert tensors.keys() == ref_tensors.keys()
    for key, want_tensors in ref_tensors.items():
        tol = 1e-5 if key.endswith(("grads", "init")) else 1e-4
        got_tensors = tensors[key]
        assert got_tensors.keys() == want_tensors.keys()
        for name, want in want_tensors.items():
            # Relative to the tensor's scale: a constant factor (e.g. TP replicas summed) fails.
            scale = want.abs().max().item()
            torch.testing.assert_close(got_tensors[name], want, rtol=tol, atol=tol * scale,
                                       msg=f"{key} {name}")


@pytest.mark.parametrize("layout_name", ["demo_colocated", "colocated_vtp2dp2_ltp1dp4", "non_colocated_2_2"])
def test_layout_reproduces_one_rank(reference, tmp_path, layout_name):
    run = _run(tmp_path, layout_name, 4)
    assert run[1].keys() == {f"{m}_{k}" for m in ("vision", "llm") for k in ("init", "grads", "params")}
    _assert_reproduces(run, reference)


@pytest.mark.parametrize("layout_name", ["demo_colocated_frozen", "non_colocated_2_2_frozen"])
def test_frozen_encoder(frozen_reference, reference, tmp_path, layout_name):
    """A frozen encoder keeps its weights bit for bit, gets no gradients, and the LLM still
    reproduces the 1-rank run (which differs from the unfrozen one: vision no longer learns)."""
    run = _run(tmp_path, layout_name, 4)
    assert "vision_grads" not in run[1]
    for name, init in run[1]["vision_init"].items():
        assert torch.equal(run[1]["vision_params"][name], init), name
    _assert_reproduces(run, frozen_reference)
    assert run[0][-1]["loss"] != reference[0][-1]["loss"]


def test_one_encoder_rank_feeds_three_llm_dp_ranks(tmp_path):
    """Non-colocated, DP 1 -> 3: vision on rank 0, LLM TP1/DP3 on ranks 1-3 (global batch 6)."""
    reference = _run(tmp_path, "single", 1, global_batch=6)
    _assert_reproduces(_run(tmp_path, "non_colocated_1_3", 4, global_batch=6), reference)


def test_distributed_optimizer(reference, tmp_path):
    """--use-distributed-optimizer on the demo layout (vision TP1/DP4, LLM TP2/DP2) reproduces the
    1-rank run. Gradients after the first backward are compared once each DP rank's reduce-scattered
    shard is all-gathered (gather_grad_shards). Each rank's AdamW state is its 1/dp share: the DP
    ranks' shares add up to the replicated state exactly, none exceeds 1/dp of it by more than
    DDP's padding."""
    run = _run(tmp_path, "demo_colocated", 4, flags=["--use-distributed-optimizer"])
    _assert_reproduces(run, reference)
    shares = {}  # (module, tp, pp) -> [(state, replicated, dp) per DP rank]
    for f in (tmp_path / "demo_colocated").glob("state_rank*.json"):
        for name, s in json.loads(f.read_text()).items():
            shares.setdefault((name, *s["replica"]), []).append((s["state"], s["replicated"], s["dp"]))
    assert {key[0] for key in shares} == {"vision", "llm"}
    for key, ranks in shares.items():
        replicated, dp = ranks[0][1], ranks[0][2]
        assert dp > 1 and len(ranks) == dp, key
        assert sum(state for state, _, _ in ranks) == replicated, key
        for state, _, _ in ranks:
            assert state <= replicated / dp * 1.01, (key, state, replicated)
