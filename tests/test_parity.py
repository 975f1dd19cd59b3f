"""End-to-end parity, the acceptance matrix: examples/pretrain_vlm.py through megatron.training's loop,
under every layout, reproduces a 1-process run with the same seed and global batch over 10 steps
(per-step loss and gradient norm within 1e-4 relative, every gradient after the first backward
within 1e-4 of its scale, parameters after the 10 steps within 1e-3), whatever its placement,
TP/CP/SP/DP/PP per module, frozen encoders or number of encoders."""

import functools
import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_hetero.models.full_state import full_tensors, gather_grad_shards
from megatron_hetero.spec.layout import load_layout
from tests.distributed import run_distributed

STEPS = 10
LAYOUTS = Path(__file__).parent.parent / "examples" / "layouts"
FLAGS = ["--train-iters", str(STEPS), "--lr", "1e-3", "--lr-decay-style", "constant", "--seed", "7",
         "--log-interval", "100"]
TWO_ENCODERS = ["--seq-length", "40"]  # image and clip tokens before the caption
TP3 = ["--hidden-size", "48", "--num-attention-heads", "6"]  # an LLM that TP 3 splits

# layout: (world size, the 1-process reference layout, flags of both runs)
CASES = {
    # colocated
    "demo_colocated": (4, "single", []),  # vision TP1/DP4 -> LLM TP2/DP2
    "colocated_vtp2dp2_ltp1dp4": (4, "single", []),
    "colocated_vdp4_ltp2cp2sp": (4, "single", ["--micro-batch-size", "4"]),
    "colocated_vdp2_lpp2": (2, "single", []),
    "colocated_vtp2dp2_lcp2dp2": (4, "single", []),
    "colocated_vdp4_lcp2pp2": (4, "single", ["--micro-batch-size", "4"]),
    "gpu2_homogeneous_cp2": (2, "single", []),  # the encoder replicated over the LLM's CP (Megatron's)
    "gpu2_homogeneous_pp2_stacked": (2, "single", []),  # the encoder on the LLM's first stage (Megatron's)
    "demo_colocated_frozen": (4, "single_frozen", []),
    "colocated_two_encoders": (4, "single_two_encoders", TWO_ENCODERS),
    "colocated_named_kinds": (4, "single_two_encoders", TWO_ENCODERS),  # modules named by `kind:`
    # the vocabulary padded for TP 3 (384 rows, 128 in one process): the padding is not the model's
    "colocated_vdp3_ltp3": (3, "single", TP3),
    # non-colocated
    "non_colocated_1_3": (4, "single", ["--global-batch-size", "6"]),
    "non_colocated_2_2": (4, "single", []),
    "non_colocated_vpp2_lpp2": (4, "single", []),
    "non_colocated_vdp2_ltp2pp2": (6, "single", []),
    "non_colocated_2_2_frozen": (4, "single_frozen", []),
    "non_colocated_two_encoders": (4, "single_two_encoders", TWO_ENCODERS),
}


SCRIPT = Path(__file__).parent.parent / "examples" / "pretrain_vlm.py"


def _save(out: Path, run, kinds, grads_too: bool = False):
    """Each held module's whole tensors (one copy per pipeline stage and expert-parallel rank):
    `kinds` of ("init", "params") from its parameters, and with `grads_too` its DP-reduced
    gradients."""
    for name, module in run.modules.items():
        if not module.held:
            continue  # non-colocated: held elsewhere
        coords, expert = module.coords(), module.layout.expert_coords(run.rank)
        todo = [(kind, False) for kind in kinds]
        if grads_too and module.ddp is not None:  # frozen: no gradients
            gather_grad_shards(module.ddp)  # distributed optimizer: each DP rank reduced its own shard
            todo.append(("grads", True))
        for kind, grads in todo:
            tensors = {}
            for experts, saver in ((False, coords["tp"] == coords["cp"] == coords["dp"] == 0),
                                   (True, expert["etp"] == expert["edp"] == 0)):
                part = full_tensors(module.part, module.pgs.tp, grads, module.pgs.expt_tp, experts=experts)
                tensors.update(part if saver else {})
            if tensors:
                torch.save(tensors, out / f"{name}_{kind}_pp{coords['pp']}_ep{expert['ep']}.pt")


def _train_and_capture(rank, world_size, layout_file, out_dir, flags):
    """examples/pretrain_vlm.py in this process (megatron.training's loop); parameters and gradients
    are captured at the first optimizer step (before it), parameters after the last."""
    from megatron.core.models.mimo.optimizer import MimoOptimizer
    from megatron.training import get_args

    out = Path(out_dir)
    step = MimoOptimizer.step

    def first_step_captured(self):
        if not getattr(MimoOptimizer, "_captured", False):
            MimoOptimizer._captured = True
            _save(out, get_args().hetero_run, ["init"], grads_too=True)
        return step(self)

    MimoOptimizer.step = first_step_captured
    sys.argv = [str(SCRIPT), "--hetero-layout", str(layout_file), "--metrics-file", str(out / "metrics.jsonl"),
                "--global-batch-size", "8", "--micro-batch-size", "2", *FLAGS, *flags]
    runpy.run_path(str(SCRIPT), run_name="__main__")
    run = get_args().hetero_run
    _save(out, run, ["params"])
    _save_state_sizes(run, out / f"state_rank{rank}.json")
    dist.barrier()


def _save_state_sizes(run, path):
    """Per module held here: Adam state elements (exp_avg, exp_avg_sq) on this rank, the replicated
    state's size (two per parameter of this rank's stage), and the DP replica it belongs to."""
    sizes = {}
    infos = run.handles.optimizer.module_infos
    for name, module in run.modules.items():
        info = infos[name]
        if not info.is_active:
            continue
        # megatron-core's optimizers (one for dense, one for expert parameters) wrap torch's
        inners = [o.optimizer for o in info.optimizer.chained_optimizers]
        coords = module.coords()
        sizes[name] = dict(
            state=sum(t.numel() for inner in inners for s in inner.state.values() for k, t in s.items()
                      if k != "step"),
            replicated=2 * sum(p.numel() for p in module.part.parameters() if p.requires_grad),
            dp=module.layout.dp * module.layout.cp, replica=[coords["tp"], coords["pp"]])
    path.write_text(json.dumps(sizes))


def _run(out: Path, layout_file: Path, world_size: int, flags: list[str], train=_train_and_capture):
    """(metrics per step, whole tensors per module and kind) of `train` (_train_and_capture or a
    function calling it) in world_size processes."""
    out.mkdir()
    run_distributed(train, world_size, layout_file, str(out), flags)
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


def _assert_reproduces(run, reference, keys=("loss", "grad_norm")):
    """`keys`: the metrics compared per step."""
    (metrics, tensors), (ref_metrics, ref_tensors) = run, reference
    assert len(metrics) == len(ref_metrics) == STEPS
    for got, want in zip(metrics, ref_metrics):
        for key in keys:
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
    layout = load_layout(LAYOUTS / f"{layout_name}.yaml", world_size)
    if layout_name == "colocated_named_kinds":  # the same modules as the reference's, other names
        run = (run[0], {key.replace("camera", "vision").replace("microphone", "audio"): value
                        for key, value in run[1].items()})
        layout = load_layout(LAYOUTS / "colocated_two_encoders.yaml", world_size)
    reference = references(reference_name, flags)
    _assert_reproduces(run, reference)
    for module in layout.modules:
        kinds = ("init", "params") if module.freeze else ("init", "grads", "params")
        assert {f"{module.name}_{k}" for k in kinds} <= run[1].keys()
        if module.freeze:  # bit for bit unchanged, no gradients
            assert f"{module.name}_grads" not in run[1]
            for name, init in run[1][f"{module.name}_init"].items():
                assert torch.equal(run[1][f"{module.name}_params"][name], init), name
    if reference_name == "single_frozen":  # the frozen reference really differs from training vision
        assert reference[0][-1]["loss"] != references("single", flags)[0][-1]["loss"]



# Micro batch 1, where the LLM input's [b, s, h] -> [s, b, h] transpose is contiguous already: views
# reach the writes that larger batches make into copies. Every layout kind against the 1-process run
# at micro batch 1: LLM TP2 without SP, colocated and non-colocated, in `make test`; the rest under `families`
# (MoE layouts: test_moe). Layout -> world size.
MICRO_BATCH_1 = ["--micro-batch-size", "1"]
MICRO_BATCH_1_CASES = {
    "gpu2_colocated": 2,  # vision DP2 -> LLM TP2 without SP
    "non_colocated_2_2": 4,  # vision DP2 -> LLM TP2 without SP, on other ranks
    "demo_colocated": 4,  # vision DP4 -> LLM TP2 DP2 without SP
    "gpu2_colocated_sp": 2,  # TP + SP
    "colocated_vdp4_ltp2cp2sp": 4,  # TP + CP + SP
    "gpu2_colocated_cp2": 2,
    "colocated_vdp2_lpp2": 2,
    "colocated_vdp4_lcp2pp2": 4,
    "non_colocated_vdp2_ltp2pp2": 6,  # LLM TP without SP over pipeline stages
}


@pytest.mark.parametrize("layout_name", [name if name in ("gpu2_colocated", "non_colocated_2_2") else
                                         pytest.param(name, marks=pytest.mark.families)
                                         for name in MICRO_BATCH_1_CASES])
def test_micro_batch_1_reproduces_one_process(references, tmp_path, layout_name):
    run = _run(tmp_path / layout_name, LAYOUTS / f"{layout_name}.yaml", MICRO_BATCH_1_CASES[layout_name],
               MICRO_BATCH_1)
    _assert_reproduces(run, references("single", MICRO_BATCH_1))


# Any number of images per sample (0 included), balanced over the encoder's DP ranks, which need
# not divide the microbatch (a rank may get no image): layout -> (world size, reference, flags).
VARIABLE = ["--images-per-sample", "0-2", "--seq-length", "64"]
VARIABLE_CASES = {
    "demo_colocated": (4, "single", VARIABLE),
    # micro batch 2 x llm dp 1 = 2 samples over vision dp 4 (formerly refused)
    "colocated_vdp4_lcp2pp2": (4, "single", [*VARIABLE, "--micro-batch-size", "2"]),
    "non_colocated_vpp2_lpp2": (4, "single", VARIABLE),
    "colocated_vdp2_lpp2": (2, "single", ["--images-per-sample", "0"]),  # text only
    "non_colocated_2_2": (4, "single", ["--images-per-sample", "0"]),
}


@pytest.mark.parametrize("layout_name", list(VARIABLE_CASES))
def test_variable_images_reproduce_one_process(references, tmp_path, layout_name):
    world_size, reference_name, flags = VARIABLE_CASES[layout_name]
    run = _run(tmp_path / layout_name, LAYOUTS / f"{layout_name}.yaml", world_size, flags)
    _assert_reproduces(run, references(reference_name, flags))


# Encoder CP: each image's patches split over the encoder's CP ranks, full attention across them
# (models/encoder.py), into LLM layouts of every kind: layout -> (world size, reference, flags, layout
# text for a layout written here). Colocated LLM TP, colocated LLM CP/DP and non-colocated LLM DP in
# `make test`; the rest under `families`.
ENCODER_CP_CASES = {
    "colocated_vcp2_ltp2": (2, "single", [], None),
    "non_colocated_vcp2_ldp2": (4, "single", [], None),
    "colocated_vcp2dp2_lcp2dp2": (4, "single", [], None),
    # 0-2 images a sample over vision DP 2: CP ranks of a DP rank without items idle together
    "colocated_vcp2dp2_ltp2sp_variable": (4, "single", VARIABLE, "vision: {role: encoder, cp: 2, dp: 2}\n"
                                                              "  llm: {role: llm, tp: 2, dp: 2, sp: true}"),
    # an encoder pipelined over CP parts: stage hidden states are each rank's part
    "non_colocated_vcp2pp2_lpp2": (6, "single", [], None),
    # the audio encoder's clips split too (CP with TP), beside a DP vision encoder
    "colocated_two_encoders_atp2cp2": (4, "single_two_encoders", TWO_ENCODERS,
                                       "vision: {role: encoder, dp: 4}\n  audio: {role: encoder, cp: 2, tp: 2}\n"
                                    "  llm: {role: llm, tp: 2, dp: 2}\nedges: [vision -> llm, audio -> llm]"),
}
ENCODER_CP_IN_MAKE_TEST = ("colocated_vcp2_ltp2", "colocated_vcp2dp2_lcp2dp2", "non_colocated_vcp2_ldp2")


@pytest.mark.parametrize("layout_name", [name if name in ENCODER_CP_IN_MAKE_TEST else
                                         pytest.param(name, marks=pytest.mark.families)
                                         for name in ENCODER_CP_CASES])
def test_encoder_cp_reproduces_one_process(references, tmp_path, layout_name):
    world_size, reference_name, flags, modules = ENCODER_CP_CASES[layout_name]
    layout = LAYOUTS / f"{layout_name}.yaml"
    if modules is not None:
        layout = tmp_path / f"{layout_name}.yaml"
        layout.write_text(f"placement: colocated\nmodules:\n  {modules}\n")
    run = _run(tmp_path / layout_name, layout, world_size, flags)
    _assert_reproduces(run, references(reference_name, flags))


# Sequence packing: 2 samples back to back per LLM sequence of twice the length, attention kept
# within each, against the unpacked 1-process run on the same samples (the same samples per LLM DP
# rank: micro batch 2 packs into 1 sequence).
PACKED = ["--pack-samples", "2", "--seq-length", "128", "--images-per-sample", "0-2"]
PACKED_CASES = {
    "single": (1, []),
    "colocated_vdp4_ltp2cp2sp": (4, ["--micro-batch-size", "4"]),  # CP2 + SP: documents split over CP
    "non_colocated_vpp2_lpp2": (4, []),  # pipeline stages on both sides
}


@pytest.mark.parametrize("layout_name", list(PACKED_CASES))
def test_packed_sequences_reproduce_unpacked_one_process(references, tmp_path, layout_name):
    world_size, flags = PACKED_CASES[layout_name]
    run = _run(tmp_path / layout_name, LAYOUTS / f"{layout_name}.yaml", world_size, [*PACKED, *flags])
    reference = references("single", [*VARIABLE, *flags])
    _assert_reproduces(run, reference)
    for got, want in zip(run[0], reference[0]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), got["step"]


@pytest.mark.parametrize("layout_name", ["demo_colocated", "non_colocated_vdp2_ltp2pp2"])
def test_distributed_optimizer(references, tmp_path, layout_name):
    """--use-distributed-optimizer reproduces the 1-process run. Gradients after the first backward
    are compared once each DP rank's reduce-scattered shard is all-gathered (gather_grad_shards).
    Each rank's AdamW state is its 1/dp share: the DP ranks' shares add up to the replicated state
    exactly, none exceeds 1/dp of it by more than DDP's padding."""
    world_size, reference_name, flags = CASES[layout_name]
    flags = [*flags, "--use-distributed-optimizer"]
    out = tmp_path / layout_name
    run = _run(out, LAYOUTS / f"{layout_name}.yaml", world_size, flags)
    _assert_reproduces(run, references(reference_name, CASES[layout_name][2]))
    shares = {}  # (module, tp, pp) -> [(state, replicated, dp) per DP rank]
    for f in out.glob("state_rank*.json"):
        for name, s in json.loads(f.read_text()).items():
            shares.setdefault((name, *s["replica"]), []).append((s["state"], s["replicated"], s["dp"]))
    assert {key[0] for key in shares} == {"vision", "llm"}
    for key, ranks in shares.items():
        replicated, dp = ranks[0][1], ranks[0][2]
        assert len(ranks) == dp, key
        assert sum(state for state, _, _ in ranks) == replicated, key
        for state, _, _ in ranks:
            assert state <= replicated / dp * 1.01, (key, state, replicated)



def _train_and_record_overlap(rank, world_size, layout_file, out_dir, flags):
    """_train_and_capture, recording for every bucket group's end-of-step wait whether its
    reduction was already issued (by the gradient hooks of the module's last backward), and the
    hooks' per-parameter counts in a last backward (DDP's "golden" counts)."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    from megatron.training import get_args

    finish, issued = _ParamAndGradBucketGroup.finish_grad_sync, []

    @functools.wraps(finish)  # megatron-hetero's patch of it checks the signature
    def recording_finish(self, *args, **kwargs):
        if not self.grad_reduce_finished:
            issued.append([self.is_first_batch, self.grad_reduce_handle is not None])
        return finish(self, *args, **kwargs)

    _ParamAndGradBucketGroup.finish_grad_sync = recording_finish
    _train_and_capture(rank, world_size, layout_file, out_dir, flags)
    counts = sorted({n for m in get_args().hetero_run.modules.values() if m.ddp is not None
                     for g in m.ddp.bucket_groups for n in g.golden_per_param_grad_ready_counts.values()})
    (Path(out_dir) / f"overlap_rank{rank}.json").write_text(json.dumps(dict(issued=issued, counts=counts)))


@pytest.mark.parametrize("layout_name, distributed_optimizer", [
    ("demo_colocated", False), ("colocated_vdp2_lpp2", True), ("non_colocated_2_2", True)])
def test_overlap_grad_reduce(references, tmp_path, layout_name, distributed_optimizer):
    """--overlap-grad-reduce (and --overlap-param-gather with the distributed optimizer): each
    module's DP reduction is issued from its last backward's gradient hooks (DDP's no_sync before
    it) and the run still reproduces the 1-process one, colocated (LLM pp=1 and pp>1, the encoder's
    backwards after the LLM's) and non-colocated."""
    world_size, reference_name, flags = CASES[layout_name]
    overlap = ["--overlap-grad-reduce", "--ddp-bucket-size", "2000"]  # several buckets per module
    if distributed_optimizer:
        overlap += ["--use-distributed-optimizer", "--overlap-param-gather"]
    out = tmp_path / layout_name
    run = _run(out, LAYOUTS / f"{layout_name}.yaml", world_size, [*flags, *overlap],
               train=_train_and_record_overlap)
    _assert_reproduces(run, references(reference_name, flags))
    for f in out.glob("overlap_rank*.json"):
        record = json.loads(f.read_text())
        # Hooks count only in a module's last backward of the step (the others run under no_sync)...
        assert record["counts"] == [1], f.name
        # ...and after the first step (upstream's: it records those counts) every bucket's
        # reduction was issued there, before the step's end: overlapped.
        later = [hooked for first, hooked in record["issued"] if not first]
        assert len(later) >= STEPS - 1 and all(later), f.name


# Colocated with a pipelined LLM, every encoder's work ordered around the pipeline
# (schedules/colocated_order.py) instead of recomputed after it: layout -> (world size, reference,
# flags of both runs).
ORDERED_CASES = {
    "colocated_vdp2_lpp2": (2, "single", []),
    # micro batch 2 x llm dp 1 over vision dp 4: ranks without items in some microbatches
    "colocated_vdp4_lcp2pp2": (4, "single", [*VARIABLE, "--micro-batch-size", "2"]),
}
# Layouts written by the test: (world size, reference, flags, modules).
ORDERED_WRITTEN = {
    # the encoder's TP group spans both LLM stages: its collectives pair across them
    "colocated_vtp4_lpp2dp2": (4, "single", [], "vision: {role: encoder, tp: 4}\n  llm: {role: llm, pp: 2, dp: 2}"),
    "colocated_two_encoders_lpp2": (4, "single_two_encoders", TWO_ENCODERS,
                                    "vision: {role: encoder, dp: 4}\n  audio: {role: encoder, tp: 2, dp: 2}\n"
                                    "  llm: {role: llm, pp: 2, dp: 2}\nedges: [vision -> llm, audio -> llm]"),
    "colocated_frozen_lpp2": (2, "single_frozen", [], "vision: {role: encoder, dp: 2, freeze: true}\n"
                                                     "  llm: {role: llm, pp: 2}"),
    # Megatron's encoder on the LLM's first stage (ranks 0-1), its gradients summed over that stage's DP
    "stacked_vdp2_lpp2dp2": (4, "single", [], "vision: {role: encoder, dp: 2, on_first_stage: true}\n"
                                              "  llm: {role: llm, pp: 2, dp: 2}"),
}


@pytest.mark.parametrize("schedule", ["three-phase", "bubbles"])
@pytest.mark.parametrize("layout_name", [*ORDERED_CASES, *ORDERED_WRITTEN])
def test_ordered_colocated_schedules_reproduce_one_process(references, tmp_path, layout_name, schedule):
    if layout_name in ORDERED_CASES:
        world_size, reference_name, flags = ORDERED_CASES[layout_name]
        layout = LAYOUTS / f"{layout_name}.yaml"
    else:
        world_size, reference_name, flags, modules = ORDERED_WRITTEN[layout_name]
        layout = tmp_path / f"{layout_name}.yaml"
        layout.write_text(f"placement: colocated\nmodules:\n  {modules}\n")
    run = _run(tmp_path / layout_name, layout, world_size, [*flags, "--hetero-colocated-schedule", schedule])
    _assert_reproduces(run, references(reference_name, flags))



def _train_and_count_passes(rank, world_size, layout_file, out_dir, flags):
    """_train_and_capture, recording the items of each of this rank's encoder passes (the
    adapter's forwards)."""
    from megatron_hetero.families.parts import VLMAdapter

    forward, passes = VLMAdapter.encoder_forward, []

    def counted(self, module, share, x):
        passes.append(sum(len(items) for _, items in share))
        return forward(self, module, share, x)

    VLMAdapter.encoder_forward = counted
    _train_and_capture(rank, world_size, layout_file, out_dir, flags)
    (Path(out_dir) / f"passes_rank{rank}.json").write_text(json.dumps(passes))


# An encoder batched over k LLM microbatches (layout `microbatches: k`), micro batch 1: name ->
# (flags of both runs, each rank's encoder passes a step and its items a pass (None: any), modules).
MICRO1 = ["--micro-batch-size", "1"]
BATCHED_WRITTEN = {
    # 8 microbatches of one image: unbatched, vision DP rank 0 would encode all 8 in 8 passes
    "colocated_vdp2k2_ltp2": ([], 4, 1, "vision: {role: encoder, dp: 2, microbatches: 2}\n  llm: {role: llm, tp: 2}"),
    # 0-2 images a sample over LLM DP 2 (4 microbatches): ranks without items in some passes
    "colocated_vdp2k4_ldp2": (VARIABLE, 1, None, "vision: {role: encoder, dp: 2, microbatches: 4}\n"
                                                 "  llm: {role: llm, dp: 2}"),
    # LLM PP 2, the recompute schedule: both encoder forwards once per pass
    "colocated_vdp2k2_lpp2": ([], 2 * 4, 1, "vision: {role: encoder, dp: 2, microbatches: 2}\n"
                                             "  llm: {role: llm, pp: 2}"),
}


@pytest.mark.parametrize("layout_name", list(BATCHED_WRITTEN))
def test_batched_encoder_reproduces_one_process(references, tmp_path, layout_name):
    """Each pass of the encoder takes the items of k microbatches, balanced over its DP ranks: k
    times fewer passes, every rank busy, and the same losses and gradients as one process."""
    flags, passes, items, modules = BATCHED_WRITTEN[layout_name]
    layout = tmp_path / f"{layout_name}.yaml"
    layout.write_text(f"placement: colocated\nmodules:\n  {modules}\n")
    out = tmp_path / layout_name
    run = _run(out, layout, 2, [*flags, *MICRO1], train=_train_and_count_passes)
    _assert_reproduces(run, references("single", flags))
    for f in out.glob("passes_rank*.json"):
        counts = json.loads(f.read_text())
        assert len(counts) <= STEPS * passes, f.name
        if items is not None:
            assert counts == [items] * (STEPS * passes), f.name
