"""End-to-end training speed of one workload under one layout; table, JSON and chart of several.

    torchrun --nproc-per-node 2 benchmarks/bench_e2e.py --workload W1 --hetero-layout L.yaml --out r.jsonl
    python benchmarks/bench_e2e.py --report r.jsonl [--png chart.png]

A run trains the workload's synthetic global batch (fixed, so data costs nothing) for --warmup +
--steps steps with megatron.training's train_step on our runtime (examples/pretrain_vlm.py's model,
forward step and flags: benchmarks/bench.py), and appends one JSON line: tokens/s, model
TFLOPS per GPU (FLOPs counted per module: encoder and projector, LLM with attention and logits; x3
for a trained module's forward and backward, x1 for a frozen one), a step-time breakdown from phase
timers in a separate pass (encoder forward/backward, boundary, LLM forward/backward, optimizer,
waiting: each phase synchronized, so the breakdown sums to more than the free-running step; each
phase's slowest rank is reported), each unpipelined encoder alone (`encoders_alone`: one step's
calls of its forward replayed back to back, each followed by its backward, synchronized only at the
ends, as the free-running step runs them: seconds per step on its slowest rank), and peak memory per
GPU (of the timed steps). On GPUs the weights are bf16 with fp32 main
params in megatron-core's optimizer (Megatron's --bf16; the record's `precision` says so; records
from before the move to megatron.training kept fp32 weights under bf16 autocast); --fp32 and CPUs:
fp32. Colocated layouts with LLM pp>1 run under --colocated-schedule (recompute, three-phase,
bubbles: README, Schedules).

Workloads: the presets of megatron_hetero.planner.presets, the table plan_layout.py plans (bf16;
images of SigLIP-so400m shape: 378 px, patch 14 -> 729 tokens, hidden 1152, 27 layers, 16 heads;
the LLM has 7B width, hidden 4096 and 32 heads; --llm-layers shrinks its depth, --seq-length,
--items-per-sample and --image-size change the sequence and images; global batch 4 in
microbatches of 2, or --global-batch N and --micro-batch N, 0 for the smallest the layout accepts):
- W1: 16 images per sample into a 16K context; W2: the same at 32K; W3: W1 with the encoder frozen
  (`freeze: true` in the layout); W4, encoder-heavy: 8 images of 448 px, patch 14 -> 1024 tokens,
  through an InternViT-6B-wide ViT (hidden 3200, 25 heads, 15 layers) into the 16K LLM; tiny: a
  CPU-sized check of the tool.
- qwen2_5_vl_7b: Qwen2.5-VL-7B's own model (families/qwen2_5_vl: its windowed native-resolution ViT,
  SwiGLU MLPs, the Qwen2 LLM with GQA and M-RoPE, vocabulary 152064), 8 images per sample of 224 x 224
  to 1344 x 1344 px at native resolution (26144 patches, 6536 rows) into an 8K sequence, global batch
  4 in microbatches of 1; its ViT's FLOPs counted as it runs (windowed layers attend within their
  112-px windows); qwen2_5_vl_tiny: its CPU-sized check.
- internvl3_8b: InternVL3-8B's model (families/internvl: InternViT-300M, pixel shuffle, the MLP projector,
  a Qwen2.5-7B-shaped Qwen2 LLM), 2 images per sample cut into 12 tiles of 448 px (3072 rows);
  qwen3_vl_8b, qwen3_vl_30b_a3b: Qwen3-VL-8B's and Qwen3-VL-30B-A3B's (families/qwen3_vl: the ViT without
  windows, DeepStack mergers into the first LLM layers, interleaved M-RoPE; a dense Qwen3 LLM or 128
  experts with top-8 routing, which fit one GPU only at a shrunk depth), 8 images of 224-1344 px per
  sample (20224 patches, 5056 rows); each with a CPU-sized `*_tiny` twin. Their configs are each family's
  presets.json (families/<name>/), and planner/families.py counts their FLOPs.
- qwen2_5_omni_7b: Qwen2.5-Omni-7B's thinker (families/qwen2_5_omni: Qwen2.5-VL's vision tower, the
  Whisper-like audio encoder of 32 layers of width 1280, the Qwen2.5-7B LLM with TMRoPE), every
  sample one 30-s 640 x 360 video sampled at 2 fps (at most 64 frames of at most 602112 px: 30
  temporal patches of 26 x 46 patches, 8970 rows) with its own audio track (3000 feature frames, 750
  rows) interleaved by 2-s chunks, at 10K, global batch 4 in microbatches of 1; --items-per-sample
  sets its videos per sample; qwen2_5_omni_tiny: its CPU-sized check. Layouts name three modules:
  vision, audio, llm (examples/layouts/*omni*.yaml).
- qwen3_omni_30b_a3b: Qwen3-Omni-30B-A3B's thinker (families/qwen3_omni: Qwen3-VL's vision tower with
  DeepStack, the audio encoder with its 2D-convolution front end, the Qwen3-MoE LLM of 128 experts,
  top 8), every sample one 30-s 640 x 360 video sampled at 2 fps (30 temporal patches of 22 x 40
  patches, 6600 rows) with its own audio track (3000 feature frames, 390 rows) merged by position
  ids, at 8K, global batch 8 in microbatches of 1; qwen3_omni_tiny: its CPU-sized check. The same
  three modules.
Each run prints, besides its JSON line, its MFU against --peak, each module's model FLOPs and
phase seconds (an encoder's forward and backward apart from the other's), each encoder's TFLOPS/GPU
and MFU by itself (its FLOPs over its seconds alone) and the order of the
modules' work in a step as each rank ran it (`work_orders`: ranks -> order, from the phase timers).
The MLPs are 4x hidden (SigLIP's is 4304 = 3.7x) and the vocabulary is the demo's (128 padded):
stated so that FLOPs can be compared with other counts.
"""

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

import torch
from ab_summary import alone_tflops_per_gpu
from bench import (
    PHASES,
    measure,
    megatron_trainer,
    profile_step,
    run_reporting_errors,
    sized_workload,
    workload_args,
)

import megatron_hetero.patches
from megatron_hetero.planner import BENCH_WORKLOADS
from megatron_hetero.planner.presets import FAMILY_BENCH_WORKLOADS
from megatron_hetero.spec.layout import SCHEDULE_FLAG, ColocatedSchedule

WORKLOADS = {**BENCH_WORKLOADS, **FAMILY_BENCH_WORKLOADS}


def run(opts) -> dict:
    from megatron_hetero.spec import rules
    from megatron_hetero.spec.layout import load_layout
    from megatron_hetero.training.args import ArgsError, check_args, check_trainable

    world = int(os.environ.get("WORLD_SIZE", 1))
    layout = load_layout(opts.hetero_layout, world)
    w = sized_workload(WORKLOADS[opts.workload], layout, opts.llm_layers, opts.global_batch, opts.micro_batch,
                       seq_length=opts.seq_length, items_per_sample=opts.items_per_sample, image_size=opts.image_size)
    bf16 = not opts.fp32 and torch.cuda.is_available()
    check_trainable(layout)
    if w.frozen and not all(m.freeze for m in layout.encoders):
        raise ArgsError(f"workload {w.name} freezes the encoder: use a layout with freeze: true on it "
                        "(e.g. examples/layouts/gpu2_colocated_frozen.yaml)")
    rules.check(ArgsError, rules.colocated_schedule_problem(layout.placement, layout.llm, opts.colocated_schedule,
                                                            layout.encoders))
    check_args(workload_args(w, opts.hetero_layout, bf16), layout)  # before any process starts
    extra, name = shlex.split(opts.flags), Path(opts.hetero_layout).stem
    if opts.colocated_schedule != ColocatedSchedule.RECOMPUTE:
        extra, name = extra + [SCHEDULE_FLAG, opts.colocated_schedule], \
            f"{name} ({opts.colocated_schedule})"
    if opts.flags:
        name = f"{name} [{opts.flags}]"
    megatron_hetero.patches.apply()
    if opts.sdpa == "efficient":  # without the flash and cuDNN kernels torch runs its memory-efficient one
        name = f"{name} (SDPA efficient)"
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    if opts.gpu_memory_gib:
        cap_memory(opts.gpu_memory_gib)
    with megatron_trainer(w, opts.hetero_layout, bf16, extra) as trainer:
        record = measure(trainer, w, name, opts.warmup, opts.steps, opts.out,
                         memory_cap_gib=opts.gpu_memory_gib or None)
        if trainer.hetero.run.rank == 0:
            print("\n".join(module_lines(record, opts.peak)))
        if opts.profile:
            trainer.hetero.timers.enabled = False  # the free-running step
            profile_step(trainer, opts.profile, trace=opts.profile_trace)
        return record


def cap_memory(gib: float) -> None:
    """This rank's GPU allocator capped at `gib` (a smaller card's memory on a larger one: which
    layouts fit there, timed on this card); an error where the GPU holds less."""
    device = int(os.environ.get("LOCAL_RANK", 0))
    total = torch.cuda.get_device_properties(device).total_memory
    if gib * 2**30 > total:
        raise SystemExit(f"error: --gpu-memory-gib {gib:g} is more than this GPU's {total / 2**30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total, device)


def module_lines(r: dict, peak: float) -> list[str]:
    """A record's MFU against `peak` dense TFLOPS per GPU, each module's model FLOPs per step and
    phase seconds (the slowest rank's, from the synchronized pass) and the order of the modules' work
    in a step, per group of ranks that ran the same (records of older runs: what they hold)."""
    lines = [f"{r['workload']} {r['layout']}: {r['tflops_per_gpu']:.1f} TFLOPS/GPU, MFU "
             f"{100 * r['tflops_per_gpu'] / peak:.1f}% of {peak:g}"]
    for module, tflop in r.get("module_tflops", {}).items():
        phases = r.get("module_phases", {}).get(module, {})
        timed = ", ".join(f"{p.rpartition('-')[2]} {s:.3f} s" for p, s in phases.items())
        lines.append(f"  {module}: {tflop:.1f} TFLOP per step{f'; {timed}' if timed else ''}")
        if module in r.get("encoders_alone", {}):
            seconds, tflops = r["encoders_alone"][module]["seconds"], alone_tflops_per_gpu(r, module)
            lines.append(f"  {module} alone (its forward and backward back to back): {seconds:.3f} s per step, "
                         f"{tflops:.1f} TFLOPS/GPU, MFU {100 * tflops / peak:.1f}%")
    for ranks, order in ((ranks, order) for ranks, order in r.get("work_orders", {}).items() if order):
        lines.append(f"  order of the work in a step, ranks {ranks}: {repeats(order)}")
    return lines


def repeats(order: list[str]) -> str:
    """The order as its shortest repeating run, e.g. "(a, b) x 4" (a step's microbatches alike)."""
    n = next(p for p in range(1, len(order) + 1) if len(order) % p == 0 and order == order[:p] * (len(order) // p))
    run = ", ".join(order[:n])
    return f"({run}) x {len(order) // n}" if n < len(order) else run


def report(path: str, png: str | None, peak: float) -> None:
    records = [json.loads(line) for line in open(path)]
    head = ["workload", "LLM layers", "layout", "gpus", "tokens/s", "TFLOPS/GPU", "MFU", "step s", "enc FLOPs",
            "peak GB", "waiting", *(f"{p} s" for p in PHASES), "attention"]
    print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    for r in records:
        cells = [r["workload"], r["llm_layers"], r["layout"], r["gpus"], f"{r['tokens_per_s']:,.0f}",
                 f"{r['tflops_per_gpu']:.1f}", f"{100 * r['tflops_per_gpu'] / peak:.1f}%",
                 _step_cell(r), f"{100 * r['encoder_flops_share']:.0f}%", f"{r['peak_gb_max']:.1f}",
                 f"{100 * r['waiting_share_max']:.1f}%",
                 *(f"{r['phases'][p]:.3f}" for p in PHASES),
                 ", ".join(f"{m} {k.split(' ')[0]}" for m, k in r.get("attention", {}).items())]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print("\n".join(["", *(line for r in records if "module_tflops" in r for line in module_lines(r, peak))]))
    if png:
        _bar_chart(records, png)


def _step_cell(r: dict) -> str:
    """Mean step seconds, with the fastest and slowest timed step where the record has them."""
    spread = f" ({r['step_s_min']:.3f}-{r['step_s_max']:.3f})" if "step_s_min" in r else ""
    return f"{r['step_s']:.3f}{spread}"


def _bar_chart(records, png: str) -> None:
    """TFLOPS/GPU per run as horizontal bars (Pillow: no plotting library needed)."""
    from PIL import Image, ImageDraw

    width, bar, left = 900, 28, 360
    top = max(r["tflops_per_gpu"] for r in records) or 1.0
    image = Image.new("RGB", (width, 40 + bar * len(records)), "white")
    draw = ImageDraw.Draw(image)
    draw.text((10, 10), "model TFLOPS per GPU", fill="black")
    for i, r in enumerate(records):
        y = 35 + i * bar
        draw.text((10, y + 6), f"{r['workload']} L{r['llm_layers']} {r['layout']} ({r['gpus']} GPU)", fill="black")
        length = int((width - left - 80) * r["tflops_per_gpu"] / top)
        draw.rectangle([left, y + 4, left + length, y + bar - 4], fill=(70, 110, 180))
        draw.text((left + length + 6, y + 6), f"{r['tflops_per_gpu']:.1f}", fill="black")
    image.save(png)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=list(WORKLOADS), default="tiny")
    parser.add_argument("--hetero-layout")
    parser.add_argument("--llm-layers", type=int, default=0, help="shrink the LLM's depth to fit")
    parser.add_argument("--global-batch", type=int, default=0, help="samples per step (default: the workload's)")
    parser.add_argument("--seq-length", type=int, default=0, help="the LLM's sequence length (default: the workload's)")
    parser.add_argument("--items-per-sample", type=int, default=0,
                        help="images per sample (default: the workload's; a family's preset images cycled to this "
                             "count)")
    parser.add_argument("--image-size", type=int, default=0,
                        help="square image size in px, a multiple of the patch size (the reference model's "
                             "workloads; default: the workload's)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="samples per LLM DP rank and microbatch (default: the workload's; 0: the "
                             "smallest the layout accepts)")
    parser.add_argument("--colocated-schedule", choices=tuple(ColocatedSchedule), default="recompute",
                        help="colocated layouts with LLM pp>1: --hetero-colocated-schedule (the record's layout "
                             "name says which, unless recompute)")
    parser.add_argument("--flags", default="",
                        help="further flags of the training script, e.g. \"--use-distributed-optimizer "
                             "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1\" "
                             "(named in the record's layout)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fp32", action="store_true",
                        help="fp32 weights and compute (default on GPUs: Megatron's --bf16, bf16 weights with "
                             "fp32 main params in the optimizer)")
    parser.add_argument("--sdpa", choices=("auto", "efficient"), default="auto",
                        help="the kernels torch's scaled_dot_product_attention may pick: auto (torch's choice) or "
                             "efficient (its memory-efficient kernel alone: the same attention rounded otherwise; "
                             "named in the record's layout)")
    parser.add_argument("--gpu-memory-gib", type=float, default=0,
                        help="cap each rank's GPU allocator at this many GiB (e.g. 79.6: an 80 GB H100's) to "
                             "see which layouts fit a smaller card; in the record as memory_cap_gib")
    parser.add_argument("--out", default="bench_e2e.jsonl")
    parser.add_argument("--profile", metavar="FILE",
                        help="after the measurement, one more step under torch.profiler: GPU kernel time by family, "
                             "the costliest kernels and where the GPU idled (rank 0's) to FILE (GPUs only)")
    parser.add_argument("--profile-trace", metavar="FILE", help="with --profile: the profiled step's Chrome trace too")
    parser.add_argument("--report", metavar="JSONL", help="print the table of a results file")
    parser.add_argument("--png", help="with --report: write a bar chart")
    parser.add_argument("--peak", type=float, default=989.0,
                        help="dense bf16 TFLOPS of the card, for MFU (989: H100 and H200 SXM)")
    opts = parser.parse_args()
    if opts.gpu_memory_gib and not torch.cuda.is_available():
        parser.error("--gpu-memory-gib caps a GPU's memory; no GPU is visible")
    if opts.profile and not torch.cuda.is_available():
        parser.error("--profile profiles GPU kernels; no GPU is visible")
    if opts.report:
        report(opts.report, opts.png, opts.peak)
        return 0
    if not opts.hetero_layout:
        parser.error("--hetero-layout is required to run (or --report to print results)")
    return run_reporting_errors(run, opts)


if __name__ == "__main__":
    sys.exit(main())
