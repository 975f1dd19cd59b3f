"""bench_e2e's workload sizing (benchmarks/bench.py, pure): overrides, the smallest micro
batch a layout accepts (the rule check_args enforces on the script's flags), the synthetic batch;
and the phase timers' accounting of nested phases."""

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from bench import global_microbatches, median_phases, sized_workload, synthetic_batch, workload_args

import megatron_hetero.patches
from megatron_hetero.data.tokenizer import CaptionTokenizer
from megatron_hetero.planner import BENCH_WORKLOADS, PRESETS, trainer_workload
from megatron_hetero.planner.families import FAMILY_BENCHES
from megatron_hetero.planner.presets import FAMILY_BENCH_WORKLOADS
from megatron_hetero.runtime.timers import PhaseTimers
from megatron_hetero.spec.layout import ModuleLayout, load_layout
from megatron_hetero.training.args import ArgsError, check_args
from tests.distributed import _free_port, run_python
from tests.tool_cli import run_tool

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ROOT / "examples" / "layouts"


@pytest.mark.parametrize("name, global_batch", [
    ("gpu8_homogeneous_tp2dp4", 24),  # LLM DP4, vision DP4
    ("gpu8_colocated_vdp4_ltp2cp2dp2", 24),  # vision DP4 over LLM DP2: 2 samples per microbatch
    ("gpu8_colocated_vdp8_ltp4pp2", 24),  # vision DP8 over LLM DP1: 1 sample, some ranks idle
    ("gpu8_non_colocated_v2_l6", 21),  # vision DP2 over LLM DP3
])
def test_smallest_micro_batch_is_the_smallest_the_script_accepts(name, global_batch):
    """The encoders' DP need not divide a microbatch (their ranks take images by cost): micro batch
    1 trains every layout; one that does not split the global batch over the LLM's DP is refused."""
    layout = load_layout(str(LAYOUTS / f"{name}.yaml"), 8)
    w = sized_workload(BENCH_WORKLOADS["W1"], layout, 32, global_batch, 0)
    assert (w.layers, w.global_batch, w.micro_batch) == (32, global_batch, 1)
    file = str(LAYOUTS / f"{name}.yaml")
    check_args(workload_args(w, file, bf16=False), layout)
    with pytest.raises(ArgsError, match="is not a multiple of --micro-batch-size x llm dp"):
        check_args(workload_args(replace(w, micro_batch=5), file, bf16=False), layout)


def test_defaults_and_a_batch_no_micro_batch_splits():
    layout = load_layout(str(LAYOUTS / "gpu2_colocated.yaml"), 2)
    assert sized_workload(BENCH_WORKLOADS["W1"], layout) == BENCH_WORKLOADS["W1"]
    layout = load_layout(str(LAYOUTS / "gpu8_non_colocated_v2_l6.yaml"), 8)
    with pytest.raises(ArgsError, match="--global-batch 16"):
        sized_workload(BENCH_WORKLOADS["W1"], layout, global_batch=16, micro_batch=0)


@pytest.mark.parametrize("name", sorted(BENCH_WORKLOADS))
def test_bench_workloads_train_the_presets_shapes(name):
    """What bench_e2e trains is the preset of the shared table as the model is built: the same
    widths, depths, heads, images and sequence, with MLPs 4 x hidden and the demo's vocabulary."""
    planned = PRESETS[name].workload
    trained = trainer_workload(BENCH_WORKLOADS[name], 128, planned.encoders[0].frozen)
    for plan, built in zip(planned.modules, trained.modules):
        assert built == replace(plan, ffn=4 * plan.hidden, vocab=built.vocab), name
    assert trained.llm.vocab == 128


@pytest.mark.parametrize("name", sorted(BENCH_WORKLOADS))
def test_the_script_accepts_every_bench_workload(name):
    """bench_e2e --workload NAME --llm-layers 8 on the 2-GPU colocated layout: the script's flag
    checks pass, and the synthetic batch holds every image's tokens before the text, in the global
    microbatches the loader would yield (micro batch x LLM DP samples each)."""
    file = str(LAYOUTS / "gpu2_colocated.yaml")
    layout = load_layout(file, 2)
    w = sized_workload(BENCH_WORKLOADS[name], layout, llm_layers=8)
    check_args(workload_args(w, file, bf16=False), layout)
    samples = synthetic_batch(w, CaptionTokenizer())
    (batch,) = global_microbatches(samples, len(samples))
    b, k, rows = w.global_batch, w.images_per_sample, w.images_per_sample * w.tokens_per_image
    assert batch["images"].shape == (b * k, 3, w.image_size, w.image_size)
    assert batch["vision_counts"].tolist() == [k] * b
    assert batch["input_ids"].shape == batch["labels"].shape == batch["loss_mask"].shape == (b, w.seq_length)
    assert batch["vision_positions"].tolist() == list(range(1, 1 + rows)) * b
    assert (batch["input_ids"][:, 1 : 1 + rows] == CaptionTokenizer().image_id).all()
    assert int(batch["loss_mask"][0].sum()) == w.seq_length - 1 - rows
    micro = global_microbatches(samples, w.micro_batch * layout.llm.dp)
    assert len(micro) == b // (w.micro_batch * layout.llm.dp)
    for key in ("images", "vision_counts", "vision_positions", "input_ids"):
        assert torch.equal(torch.cat([m[key] for m in micro]), batch[key]), key


def test_phases_are_medians_over_the_timed_steps():
    """One slow step of the phase-timed ones (a recompilation, a stall) does not move a phase; a phase
    a step did not run counts 0 there."""
    steps = [{"encoder-forward": 0.4, "llm-forward": 0.2}, {"encoder-forward": 1.5, "llm-forward": 0.2},
             {"encoder-forward": 0.41, "optimizer": 0.1}]
    assert median_phases(steps) == {"encoder-forward": 0.41, "llm-forward": 0.2, "optimizer": 0.0}


def test_nested_phases_count_once_and_switch_relabels():
    """A phase inside another counts as itself only; switch() moves the rest of the open phase to
    another name; the phases are listed as they open (the order of the work); off, nothing is counted."""
    ticks = iter(range(100))
    timers = PhaseTimers(torch.device("cpu"), enabled=True)
    timers._now = lambda: next(ticks)  # one second per reading
    with timers("llm-forward"):  # reads 0
        with timers("encoder-forward"):  # reads 1, 2
            pass
        timers.switch("boundary")  # reads 3
    # closes at 4
    counted = {"llm-forward": 2, "encoder-forward": 1, "boundary": 1}
    assert timers.seconds == counted
    assert timers.opened == [("llm-forward", None), ("encoder-forward", None), ("boundary", None)]
    timers.enabled = False
    with timers("optimizer"):
        timers.switch("llm-backward")
    assert timers.seconds == counted


def _parameters_as_built(rank, world_size):
    from bench import megatron_trainer

    megatron_hetero.patches.apply()
    with megatron_trainer(BENCH_WORKLOADS["tiny"], str(LAYOUTS / "single.yaml"), bf16=False) as trainer:
        return [tuple(p.shape) for p in trainer.hetero.parameters()]


def test_trainer_parameter_shapes_are_the_built_models(tmp_path):
    """The parameter list bench_ops steps Adam over is the one the trainer builds, shape for shape."""
    from megatron_hetero.planner.presets import trainer_parameter_shapes, trainer_vocab_size
    from tests.distributed import collect_distributed

    (built,) = collect_distributed(_parameters_as_built, 1, tmp_path)
    assert built == trainer_parameter_shapes(BENCH_WORKLOADS["tiny"], trainer_vocab_size())


def _alone_and_at_once(rank, world_size):
    """The gradients encoders_alone leaves in the ViT's buffers (one replay, taken as it zeroes them)
    and those of one forward of all the step's images at once, the sum of its rows backpropagated;
    the seconds it reports."""
    from bench import _EncoderCalls, encoders_alone, megatron_trainer

    from megatron_hetero.schedules.step import first_stage_inputs

    megatron_hetero.patches.apply()
    w = FAMILY_BENCH_WORKLOADS["qwen2_5_vl_tiny"]
    with megatron_trainer(w, str(LAYOUTS / "single.yaml"), bf16=False) as trainer:
        hetero = trainer.hetero
        vision, adapter = hetero.run.modules["vision"], hetero.adapter
        hetero.adapter = capture = _EncoderCalls(adapter)
        trainer.train_step()
        hetero.adapter = adapter
        taken, zero = [], vision.ddp.zero_grad_buffer
        vision.ddp.zero_grad_buffer = lambda: (taken.append([p.main_grad.clone() for p in vision.part.parameters()]),
                                               zero())
        seconds = encoders_alone(trainer, None, repeats=1)
        vision.ddp.zero_grad_buffer = zero
        left = [p.main_grad.clone() for p in vision.part.parameters()]
        with vision.ddp.no_sync():
            share = [s for _, share in capture.calls for s in share]
            adapter.encoder_forward(vision, share, first_stage_inputs(adapter, vision, share)).sum().backward()
        return seconds, len(capture.calls), taken[-1], [p.main_grad.clone() for p in vision.part.parameters()], left


def test_the_encoder_calls_kept_are_the_trained_forwards():
    """What encoders_alone replays: a trainable encoder's forward with autograd on (not the recompute
    schedule's first pass without a graph), a frozen encoder's forward, no pipelined stage's."""
    from types import SimpleNamespace

    from bench import _EncoderCalls

    class Adapter:
        def encoder_forward(self, module, share, hidden):
            return share

    def module(name, ddp=object(), stages=(True, True)):
        return SimpleNamespace(name=name, ddp=ddp, first_stage=stages[0], last_stage=stages[1])

    trained, frozen, staged = module("vision"), module("audio", ddp=None), module("video", stages=(True, False))
    calls = _EncoderCalls(Adapter())
    with torch.no_grad():
        assert calls.encoder_forward(trained, "rows without a graph", None) == "rows without a graph"
        calls.encoder_forward(frozen, "frozen", None)
    for m in (trained, staged):
        calls.encoder_forward(m, m.name, None)
    assert calls.calls == [(frozen, "frozen"), (trained, "vision")]


def test_an_encoder_alone_replays_the_steps_encoder_work(tmp_path):
    """bench_e2e's encoders-alone pass (bench.encoders_alone) runs the step's encoder work: on the
    Qwen2.5-VL twin (global batch 4, one sample per microbatch: four calls of the ViT) its replayed
    calls' gradients equal those of one call on all the step's images (each row's gradient one),
    and it leaves the gradient buffers zeroed."""
    from tests.distributed import collect_distributed

    ((seconds, calls, replayed, at_once, left),) = collect_distributed(_alone_and_at_once, 1, tmp_path)
    assert set(seconds) == {"vision"} and seconds["vision"] > 0 and calls == 4
    assert all(g.abs().sum() > 0 for g in at_once) and not any(g.abs().sum() > 0 for g in left)
    for got, want in zip(replayed, at_once, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---- a VLM family's workload (Qwen2.5-VL) ------------------------------------------------------
def test_family_workload_counts_the_vit_as_it_runs():
    """The Qwen2.5-VL presets' attention keys are what the model's own window layout (transformers'
    cu_seqlens of images and windows) makes: full layers within images, the others within windows.
    (tests/test_family_flops.py: every family's count against its model's matmuls, and the presets'
    image grids against the processors.)"""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_window_index

    from megatron_hetero.planner.counts import attended_tokens

    for bench in (b for b in FAMILY_BENCHES.values() if b.model_type == "qwen2_5_vl"):
        v = bench.config["vision_config"]
        grids = torch.tensor([(1, h, w) for h, w in bench.images.values()])
        _, windows = get_vision_window_index(grids, v["spatial_merge_size"], v["window_size"], v["patch_size"])
        pairs = {name: float((cu.diff().double() ** 2).sum())
                 for name, cu in (("images", get_vision_cu_seqlens(grids)), ("windows", windows))}
        full, layers = len(v["fullatt_block_indexes"]), v["depth"]
        want = (full * pairs["images"] + (layers - full) * pairs["windows"]) / (layers * int(grids.prod(1).sum()))
        vision = bench.workload().encoders[0]
        assert attended_tokens(vision) == pytest.approx(want, rel=1e-12)
        assert vision.tokens_per_sample == int(grids.prod(1).sum()) == 4 * vision.rows_per_sample


@pytest.mark.parametrize("name", sorted(n for n, b in FAMILY_BENCHES.items()
                                        if not n.endswith("_tiny") and not b.videos))  # Omni's: below
def test_the_family_gpu_presets_pass_the_script_and_batch(name):
    """What benchmarks/gpu_families_run.sh trains, short of building the model: bench_e2e's flags for the
    preset at --llm-layers 4 on the one-GPU layout pass the script's checks (the model's sizes from
    the family's Hugging Face config), and a sample's synthetic batch holds the planned items, patches
    and rows, every row at an image placeholder of the family's config."""
    from bench import family_batch, family_sizes

    from megatron_hetero.planner.presets import trainer_vocab_size
    from megatron_hetero.spec.sizes import padded_vocab_size

    file = str(LAYOUTS / "single.yaml")
    layout = load_layout(file, 1)
    w = sized_workload(FAMILY_BENCH_WORKLOADS[name], layout, llm_layers=4, global_batch=1)
    check_args(workload_args(w, file, bf16=False), layout)  # --bf16 is for GPUs only
    vision = trainer_workload(w, 1, False).encoders[0]
    (batch,) = global_microbatches(family_batch(w), 1)
    assert int(batch["vision_counts"].sum()) == len(batch["vision_rows"]) == vision.items_per_sample
    assert batch["vision_positions"].numel() == int(batch["vision_rows"].sum()) == vision.rows_per_sample
    if "vision_grids" in batch:  # native resolution: the images' patches
        assert batch["images"].shape[0] == int(batch["vision_grids"].prod(1).sum()) == vision.tokens_per_sample
    placeholder = FAMILY_BENCHES[name].config["image_token_id"]
    assert (batch["input_ids"][0, batch["vision_positions"]] == placeholder).all()
    assert int((batch["input_ids"] == placeholder).sum()) == vision.rows_per_sample
    # The planner's vocabulary for it (the FLOPs, the out-of-memory line's plan) is the model's padded one.
    assert trainer_vocab_size(w) == padded_vocab_size(family_sizes(w))


def test_a_family_depth_without_room_for_deepstack_is_one_line():
    """Qwen3-VL's 3 DeepStack mergers feed LLM layers 0-2: --llm-layers 2 is refused naming the flag."""
    file = str(LAYOUTS / "single.yaml")
    w = sized_workload(FAMILY_BENCH_WORKLOADS["qwen3_vl_8b"], load_layout(file, 1), llm_layers=2)
    with pytest.raises(ArgsError, match=r"^--llm-layers 2: qwen3_vl: .*deepstack_visual_indexes \[8, 16, 24\]"):
        workload_args(w, file, bf16=False)


@pytest.mark.parametrize("name", ["qwen2_5_vl_tiny", *(pytest.param(n, marks=pytest.mark.families) for n in
                                                       ("internvl_tiny", "qwen3_vl_tiny", "qwen3_vl_moe_tiny"))])
def test_family_workload_trains_on_cpu(tmp_path, name):
    """bench_e2e's family workloads (their CPU-sized twins) train through megatron.training on one
    process: the family's model from its config, its images (native resolution or tiles), M-RoPE
    positions, DeepStack rows, MoE experts. Qwen2.5-VL's in `make test`, the others'
    in `make test-families`."""
    layout = tmp_path / "single.yaml"
    layout.write_text("placement: colocated\nmodules:\n  vision: {role: encoder}\n  llm: {role: llm}\n")
    out = tmp_path / "bench.jsonl"
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    result = run_python([ROOT / "benchmarks" / "bench_e2e.py", "--workload", name, "--hetero-layout", layout,
                         "--out", out, "--warmup", "1", "--steps", "1"], env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["workload"] == name and 0 < record["encoder_flops_share"] < 1


def test_a_memory_cap_without_a_gpu_is_one_line():
    result = run_tool("bench_e2e", "--workload", "tiny", "--hetero-layout", "examples/layouts/single.yaml",
                      "--gpu-memory-gib", "79.6")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith("--gpu-memory-gib caps a GPU's memory; no GPU is visible")


def test_host_syncs_counts_each_wait_where_it_was_called(monkeypatch):
    """host_syncs (profile_step's host waits) counts torch's sync-debug warnings by call site, and
    only those: here a fake step warns as torch does, twice from one line, once from another."""
    import inspect
    import warnings

    import bench

    modes, lines = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def wait():
        lines.append(inspect.currentframe().f_lineno + 1)
        warnings.warn("called a synchronizing CUDA operation")

    class Step:
        def train_step(self, forward_backward_func):
            wait(), wait()
            lines.append(inspect.currentframe().f_lineno + 1)
            warnings.warn("called a synchronizing CUDA operation")
            warnings.warn("something else")

    sites = bench.host_syncs(Step())
    # The innermost frame of the package here is host_syncs' call of the step.
    assert [(site.split(" <- ")[1], n) for site, n in sites] == [
        (f"test_bench_e2e.py:{lines[0]}", 2), (f"test_bench_e2e.py:{lines[2]}", 1)], sites
    assert all(site.startswith("bench.py:") for site, _ in sites), sites
    assert modes == ["warn", "default"]


def test_matmul_lines_rate_each_shape_by_its_kernels_time():
    """The profile's matmul table: torch.profiler counts 2*M*N*K per mm (checked on the CPU), and each
    row's rate is its FLOPs over its kernels' GPU time; other ops, and ops without GPU time, are left out."""
    from types import SimpleNamespace

    from bench import matmul_lines
    from torch.profiler import ProfilerActivity, profile

    a, b = torch.randn(64, 32), torch.randn(32, 48)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        for _ in range(3):
            torch.mm(a, b)
    (mm,) = [e for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::mm"]
    assert mm.count == 3 and mm.flops == 3 * 2 * 64 * 32 * 48

    def event(key, flops, us, shapes=((4096, 1024), (1024, 4096))):
        return SimpleNamespace(key=key, input_shapes=[list(s) for s in shapes], count=10, flops=flops,
                               device_time_total=us)

    big = event("aten::addmm", 10 * 2 * 4096 * 1024 * 4096, 1000.0)
    small = event("aten::mm", 10 * 2 * 64 * 64 * 64, 50.0, ((64, 64), (64, 64)))
    rows = matmul_lines([small, event("aten::mul", 10**9, 5000.0), event("aten::mm", 10**12, 0.0), big])[5:]
    assert rows == [f"| aten::addmm | {big.input_shapes} | 10 | 1.0 | {big.flops / 1000.0 / 1e6:.0f} |",
                    f"| aten::mm | {small.input_shapes} | 10 | 0.1 | {small.flops / 50.0 / 1e6:.0f} |"]


def test_matmul_calls_give_each_shape_its_spread_and_kernels():
    """The matmul table's per-call columns: each call's kernels summed, min / median / max over calls,
    the kernels' names; shapes and ops apart, other ops and calls without kernels left out."""
    from types import SimpleNamespace

    from bench import matmul_calls, matmul_lines

    def call(name, shapes, *kernels):
        return SimpleNamespace(name=name, input_shapes=shapes,
                               kernels=[SimpleNamespace(name=k, duration=us) for k, us in kernels])

    shape, other = [[8, 4], [4, 8]], [[8, 8], [8, 8]]
    events = [call("aten::mm", shape, ("gemm_a", 1000.0)), call("aten::mm", shape, ("gemm_a", 3000.0)),
              call("aten::mm", shape, ("gemm_b", 1500.0), ("copy", 500.0)), call("aten::mm", other, ("gemm_c", 10.0)),
              call("aten::mul", shape, ("mul", 99.0)), call("aten::mm", shape)]
    calls = matmul_calls(events)
    assert calls == {("aten::mm", str(shape)): ([1.0, 3.0, 2.0], {"gemm_a", "gemm_b", "copy"}),
                     ("aten::mm", str(other)): ([0.01], {"gemm_c"})}
    row = SimpleNamespace(key="aten::mm", input_shapes=shape, count=3, flops=6 * 10**9, device_time_total=6000.0)
    assert matmul_lines([row], calls)[-1].endswith("| 1.00 / 2.00 / 3.00 | copy, gemm_a, gemm_b |")
    assert matmul_lines([row])[-1].endswith("| 1 |")


def test_idle_gaps_charge_each_wait_to_the_kernel_after_it():
    """The profile's idle table: the GPU's gaps between kernels of every stream together (a kernel
    running beside another on a second stream leaves none), each charged to the label of the kernel
    that ends it, per label its count, total and largest; the device-side copies of annotated ranges
    are not kernels, and each kernel is labelled by the op that launched it under its outermost caller."""
    from types import SimpleNamespace

    from bench import device_work, idle_gaps, idle_lines, largest_gaps, launched_kernels

    kernels = [(0, 10, "a"), (5, 30, "b"), (12, 20, "c"),  # c runs beside b: no gap
               (40, 45, "d"), (45, 50, "a"), (52, 60, "d"), (100, 101, "d"), (101, 103, "a")]
    assert idle_gaps(kernels) == [("d", 3, 10 + 2 + 40, 40)]
    assert idle_gaps([(3, 4, "x")]) == [] and idle_gaps([]) == []
    # Each gap after the kernel that ran longest so far (b, not c beside it), when counted from a's start.
    assert largest_gaps(kernels, top=2) == [(60, 40, "d", "d"), (30, 10, "b", "d")]
    assert largest_gaps([(3, 4, "x")]) == [] and largest_gaps([]) == []

    cuda, cpu = SimpleNamespace(name="CUDA"), SimpleNamespace(name="CPU")

    def op(start, name, parent=None, kernels=()):
        """A CPU op's event: the kernels it launched by (name, duration), as torch lists them."""
        return SimpleNamespace(name=name, cpu_parent=parent, device_type=cpu, self_device_time_total=0,
                               time_range=SimpleNamespace(start=start, end=start + 1),
                               kernels=[SimpleNamespace(name=k, duration=d) for k, d in kernels])

    def on_gpu(name, start, end, annotation=False):
        return SimpleNamespace(name=name, device_type=cuda, time_range=SimpleNamespace(start=start, end=end),
                               self_device_time_total=end - start, is_user_annotation=annotation)

    node = op(0, "autograd::engine::evaluate_function: FlashAttnVarlenFuncBackward")
    # Two ops launch a kernel of the same name and duration: each goes to its op in launch order.
    events = [node, op(5, "aten::copy_", node, [("copy", 500)]),
              op(1, "aten::mm", None, [("gemm", 1000), ("gemm", 100)]),
              op(7, "aten::addmm", None, [("gemm", 100)]), op(8, "cudaLaunchKernel"),
              on_gpu("gemm", 0, 1000), on_gpu("copy", 1500, 2000), on_gpu("gemm", 3000, 3100),
              on_gpu("gemm", 3300, 3400), on_gpu("fill", 3500, 3600),  # no op lists the fill: unknown
              on_gpu("range", 0, 4000, annotation=True)]  # an annotated range's device-side copy spans them all
    assert len(device_work(events)) == 5
    assert [label for *_, label in launched_kernels(events)] == [
        "aten::mm", "aten::copy_ <- FlashAttnVarlenFuncBackward", "aten::mm", "aten::addmm", "(no launching op)"]
    lines = idle_lines(events)
    gaps = lines.index("| when ms | idle ms | after | before |")
    assert lines[gaps - 7:gaps - 3] == ["| aten::mm | 1 | 1.0 | 1.00 |",
                                        "| aten::copy_ <- FlashAttnVarlenFuncBackward | 1 | 0.5 | 0.50 |",
                                        "| aten::addmm | 1 | 0.2 | 0.20 |",
                                        "| (no launching op) | 1 | 0.1 | 0.10 |"]
    assert lines[gaps + 2:gaps + 4] == ["| 2.0 | 1.00 | aten::copy_ <- FlashAttnVarlenFuncBackward | aten::mm |",
                                        "| 1.0 | 0.50 | aten::mm | aten::copy_ <- FlashAttnVarlenFuncBackward |"]


def test_sequence_and_images_overrides_resize_the_workload():
    """--seq-length and --items-per-sample: a family's preset images cycled to the count (the ViT's
    tokens scale with them), the reference model's count as given; --image-size only where the
    model's images are square ones of the trainer's, in whole patches (one line otherwise)."""
    layout = load_layout(str(LAYOUTS / "gpu2_colocated.yaml"), 2)
    family = FAMILY_BENCH_WORKLOADS["qwen2_5_vl_7b"]
    w = sized_workload(family, layout, seq_length=32768, items_per_sample=20)
    assert (w.seq_length, w.images_per_sample) == (32768, 20)
    assert w.image_sizes == family.image_sizes * 2 + family.image_sizes[:4]
    preset = trainer_workload(family, 1, False).encoders[0]
    grown = trainer_workload(replace(w, image_sizes=family.image_sizes * 3), 1, False).encoders[0]
    assert grown.items_per_sample * grown.tokens_per_item == 3 * preset.items_per_sample * preset.tokens_per_item
    assert trainer_workload(w, 1, False).llm.seq_length == 32768
    w1 = sized_workload(BENCH_WORKLOADS["W1"], layout, items_per_sample=4, image_size=224)
    assert (w1.images_per_sample, w1.tokens_per_image) == (4, 16 * 16)
    with pytest.raises(ArgsError, match="--image-size: qwen2_5_vl_7b trains its preset's native-resolution"):
        sized_workload(family, layout, image_size=448)
    with pytest.raises(ArgsError, match="--image-size 230: not a multiple of W1's 14-px patches"):
        sized_workload(BENCH_WORKLOADS["W1"], layout, image_size=230)


# ---- Qwen2.5-Omni and Qwen3-Omni: a video with its audio track, two encoders ---------------------
@pytest.mark.parametrize("name", ["qwen2_5_omni_tiny", "qwen2_5_omni_7b", "qwen3_omni_tiny", "qwen3_omni_30b_a3b"])
def test_omni_presets_videos_are_the_processors(name):
    """The Omni presets' videos: the patch grid the family's video processor makes of the video's
    size, length and rate under the preset's caps, and its audio track's feature frames the
    extractor makes; the planner's shapes hold the video's patches and rows and the track's rows;
    bench_e2e's flags for it (at 4 LLM layers, one GPU) pass the script's checks."""
    from bench import _family_items, family_sizes
    from transformers import AutoConfig

    from megatron_hetero.families import family_named

    bench, file = FAMILY_BENCHES[name], str(LAYOUTS / "single_omni.yaml")
    w = sized_workload(FAMILY_BENCH_WORKLOADS[name], load_layout(file, 1), llm_layers=4)
    check_args(workload_args(w, file, bf16=False), load_layout(file, 1))  # the script's checks pass
    media = family_named(w.family).media(family_sizes(w), bench.processor,
                                         AutoConfig.for_model(bench.model_type, **bench.hf_config()).to_dict())
    (video,), (audio,) = _family_items(w, media)
    ((size, (grid, frames)),) = bench.videos.items()
    assert video.grids == (grid,) and audio.grids == ((1, 1, frames),), (video.grids, audio.grids)
    vision_shape, audio_shape = trainer_workload(w, 1, False).encoders
    assert vision_shape.tokens_per_item == math.prod(grid) and vision_shape.rows_per_item == sum(video.rows)
    assert audio_shape.rows_per_item == audio.rows[0] == video.audio_rows


def test_omni_batch_interleaves_the_audio_rows_in_the_video_tag():
    """bench_e2e's Omni sample: the video's tag holds the frames' and the audio's placeholders
    (interleaved by chunks of time), each encoder's rows fill its own placeholders, and text after."""
    from bench import family_batch

    w = replace(FAMILY_BENCH_WORKLOADS["qwen2_5_omni_tiny"], global_batch=2)
    config = FAMILY_BENCHES[w.name].config
    batch = global_microbatches(family_batch(w), 2)[0]
    shapes = trainer_workload(w, 1, False)
    ids = batch["input_ids"][0]
    for kind, shape, placeholders in ((("vision", shapes.encoders[0], (config["video_token_index"],)),
                                       ("audio", shapes.encoders[1], (config["audio_token_index"],)))):
        at = batch[f"{kind}_positions"][: shape.rows_per_sample]
        assert torch.isin(ids[at], torch.tensor(placeholders)).all() and len(at) == shape.rows_per_sample
    vision, audio = batch["vision_positions"][:32], batch["audio_positions"][:100]
    assert vision.min() < audio.min() < vision.max() < audio.max()  # 2-s chunks of each in turn
    assert batch["audio"].shape == (2 * 400, 16) and batch["audio_grids"].tolist() == [[1, 1, 400]] * 2
    assert int(batch["loss_mask"][0].sum()) > 0


@pytest.mark.parametrize("name", ["qwen2_5_omni_tiny", "qwen3_omni_tiny"])
def test_omni_workload_trains_on_cpu_and_states_the_order_of_its_encoders(tmp_path, name):
    """bench_e2e on the CPU-sized Omni thinkers (examples/layouts/single_omni.yaml): the record holds
    each module's model FLOPs and phases, the vision tower's and the audio encoder's apart, and the
    order of their work as docs/guides/layouts.md states it (colocated, LLM pp 1: per microbatch each
    encoder's forward in layout order, the LLM's forward and one backward through all three)."""
    out = tmp_path / "bench.jsonl"
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    result = run_python([ROOT / "benchmarks" / "bench_e2e.py", "--workload", name, "--hetero-layout",
                         LAYOUTS / "single_omni.yaml", "--out", out, "--warmup", "0", "--steps", "1"], env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    assert list(record["module_tflops"]) == ["vision", "audio", "llm"]
    for encoder in ("vision", "audio"):
        assert set(record["module_phases"][encoder]) == {"encoder-forward", "encoder-backward"}
    ((ranks, order),) = record["work_orders"].items()
    per_microbatch = len(order) // 4  # global batch 4 in microbatches of 1
    assert order == order[:per_microbatch] * 4
    assert order[:4] == ["vision forward", "audio forward", "llm forward", "llm backward"]
    assert sorted(order[4:per_microbatch]) == ["audio backward", "vision backward"]
    assert ranks == "0" and "order of the work in a step, ranks 0: (vision forward, audio forward, llm forward" \
        in result.stdout


def test_the_planner_and_layout_check_take_the_omni_audio_encoder_under_cp():
    """Audio encoder CP (each audio split by rows): the planner ranks layouts with it among those that
    fit the Omni-7B shape on 4 GPUs, and the layout rules accept `cp: 2` on the audio module."""
    from bench import family_sizes

    from megatron_hetero.families import encoder_cp_tokens
    from megatron_hetero.planner import Calibration, Cluster, plan
    from megatron_hetero.spec import rules

    workload = replace(PRESETS["qwen2_5_omni_7b"].workload, distributed_optimizer=True, allow_recompute=True)
    ranked = plan(workload, Cluster(4, 80), Calibration()).ranked
    assert any(p.candidate.layouts[1].name == "audio" and p.candidate.layouts[1].cp == 2 for p in ranked)
    sizes = family_sizes(FAMILY_BENCH_WORKLOADS["qwen2_5_omni_tiny"])
    audio = ModuleLayout("audio", "encoder", cp=4)
    assert rules.encoder_cp_problem(audio, encoder_cp_tokens(audio, sizes)) is None


def test_the_planner_plans_the_qwen3_omni_thinker_with_expert_parallelism_and_no_audio_cp():
    """Qwen3-Omni-30B-A3B's thinker on 8 GPUs: the vision tower, the audio encoder and the MoE LLM,
    whose experts fit only split over EP; the audio encoder, which the family runs without CP, takes
    CP only replicated (the homogeneous baseline's)."""
    from megatron_hetero.planner import Calibration, Cluster, plan

    preset = PRESETS["qwen3_omni_30b_a3b"]
    result = plan(preset.workload, Cluster(preset.gpus, 150.7), Calibration())
    best = result.best().candidate
    assert [layout.name for layout in best.layouts] == ["vision", "audio", "llm"] and best.llm.ep > 1
    audio = [p.candidate.layouts[1] for p in result.ranked + result.over_memory]
    assert all(layout.cp == 1 or layout.cp_replicated for layout in audio)


def test_host_lines_rank_ops_by_host_time_beside_their_gpu_time():
    """The profile's host table: CPU ops by host time (callees included), per call, beside the GPU time
    of what they launched; the GPU's own rows and ops that took no host time are not listed."""
    from types import SimpleNamespace

    from bench import host_lines

    def row(key, kind, count, cpu_us, device_us=0.0):
        return SimpleNamespace(key=key, device_type=SimpleNamespace(name=kind), count=count,
                               cpu_time_total=cpu_us, device_time_total=device_us)

    averages = [row("_LinearAct", "CPU", 4, 2000.0, 8000.0), row("gemm", "CUDA", 4, 0.0, 8000.0),
                row("aten::empty", "CPU", 10, 0.0), row("FlashAttnVarlenFunc", "CPU", 2, 3000.0, 1000.0)]
    assert host_lines(averages)[-2:] == ["| FlashAttnVarlenFunc | 2 | 3.0 | 1500 | 1.0 |",
                                         "| _LinearAct | 4 | 2.0 | 500 | 8.0 |"]
    assert host_lines(averages, top=1)[-1].startswith("| FlashAttnVarlenFunc |")


def test_python_lines_rank_the_hosts_functions_by_own_and_total_time():
    """The profile's Python tables: one step's functions under cProfile, by own time and with callees."""
    import cProfile
    import pstats

    from bench import python_lines

    def inner():
        return sum(i * i for i in range(200_000))

    def outer():
        return inner() + inner()

    with cProfile.Profile() as host:
        outer()
    lines = python_lines(pstats.Stats(host), top=3)
    by_total = lines[lines.index("The host's Python functions in one step under cProfile, by callees included:"):]
    assert "(outer) | 1 |" in by_total[4] and "(inner) | 2 |" in by_total[5]
    assert len(lines) == 2 * (5 + 3)


def test_gc_time_counts_each_collection_by_generation():
    """The record's garbage-collection figures (GcTime): each collection while inside, by generation,
    with the host's seconds; none counted after it."""
    import gc

    from bench import GcTime

    gc.disable()  # only the collections asked for
    try:
        with GcTime() as collected:
            gc.collect()
            gc.collect(1)
        gc.collect()
    finally:
        gc.enable()
    assert collected.counts == [0, 1, 1] and collected.seconds[2] > 0
