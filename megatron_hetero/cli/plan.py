"""Plan a heterogeneous layout: predict step time and memory per GPU for every valid colocated,
non-colocated and homogeneous (Megatron today) layout of a workload, print the best, the best
homogeneous one and the predicted gain, and write a layout file for the best.

    megatron-hetero plan --workload W1 [--gpus 2] [--gpu h100|h200] [--gpu-memory-gb 150] \\
        [--calibration h200_measured|FILE] [--write-yaml best.yaml]
    megatron-hetero plan --workload-file my_workload.json --gpus 16 --layouts a.yaml b.yaml

(`python tools/plan_layout.py` runs the same.) The calibration, unless --calibration names one, is
the one measured on the GPU model named by --gpu, else detected by nvidia-smi, else the H200's; the
first lines printed say which.

Every figure is a prediction of the cost model in megatron_hetero/planner/ (its docstring states
the model, megatron_hetero.planner.calibration's the calibration JSON format), not a measurement.
Presets: W1, W2, W3 (a SigLIP-so400m ViT into a 7B LLM on 2 GPUs), W4 (encoder-heavy: an
InternViT-6B-wide ViT into a 7B LLM on 2 GPUs), tiny (a CPU-sized check), paper (a 6B ViT into a
70B LLM on 64 GPUs) and moe (a ViT into a Qwen3-30B-A3B-shaped MoE LLM on 8 GPUs); see
megatron_hetero.planner.presets. A workload file is JSON:

    {"encoders": [{"name": "vision", "hidden": 1152, "layers": 27, "heads": 16, "ffn": 4304,
                   "tokens_per_item": 729, "items_per_sample": 16, "projector_ffn": 16384}],
     "llm": {"name": "llm", "hidden": 4096, "layers": 32, "heads": 32, "ffn": 16384,
             "seq_length": 16384, "vocab": 32000},
     "global_batch": 16}

(further shape keys: kv_heads, gated_mlp, output_tokens_per_item, frozen, experts and topk (an
MoE LLM: experts MLPs of width ffn, topk per token); workload keys:
micro_batch, dtype_bytes, distributed_optimizer, allow_recompute, fused_mlp, fused_gated_bias_mlp,
grouped_experts, fused_cross_entropy, quack_cross_entropy).
"""

import argparse
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from megatron_hetero.planner import (
    BENCH_WORKLOADS,
    H200_MEMORY_GB,
    PRESETS,
    Calibration,
    Cluster,
    CostModel,
    Workload,
    best_micro_batch,
    candidate_from_layout,
    explain,
    layout_yaml,
    module_params,
    plan,
    trainer_workload,
)
from megatron_hetero.planner.calibration import shipped_calibration, shipped_names
from megatron_hetero.planner.presets import FAMILY_BENCH_WORKLOADS, resized_workload, trainer_vocab_size
from megatron_hetero.planner.shapes import H100_MEMORY_GB
from megatron_hetero.spec.layout import load_layout

# "Heterogeneous Parallelism for Multimodal Large Language Model Training" (arXiv 2605.27678).
PUBLISHED = {"colocated": "+49.3% TFLOPS/GPU", "non_colocated": "+13.0% tokens/s"}


# GPU model -> (memory per GPU in GB, the calibration fitted to bench_e2e runs on it).
GPUS = {"h100": (H100_MEMORY_GB, "h100_measured"), "h200": (H200_MEMORY_GB, "h200_measured")}


class _Renamed(argparse.Action):
    """A flag's old name, kept working as its new (Megatron's) name with one warning line."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"warning: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def gpu_model(names: str) -> str | None:
    """The first GPU model of GPUS that `names` mention (a GPU's name as nvidia-smi or torch give it)."""
    return next((gpu for gpu in GPUS if gpu.upper() in names.upper()), None)


def _detected_gpu() -> str | None:
    """This machine's GPU model among GPUS, as nvidia-smi names it (no torch import: planning is pure)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return gpu_model(names)


def resolve_calibration(args) -> str:
    """The calibration file (a shipped name such as h200_measured, or a path; by default the measured
    one of the GPU named or detected), the memory per GPU it defaults, and one line saying which."""
    detected = None if args.gpu else _detected_gpu()
    gpu = args.gpu or detected or "h200"
    how = "named by --gpu" if args.gpu else "detected by nvidia-smi" if detected else "default; --gpu h100: the H100's"
    if args.gpu_memory_gb is None:
        args.gpu_memory_gb = GPUS[gpu][0]
    name = args.calibration or GPUS[gpu][1]
    shipped = shipped_calibration(name)
    if not shipped.is_file() and not Path(name).is_file():
        raise ValueError(f"--calibration {name}: neither a file nor a shipped calibration; name a file or one of "
                         f"{', '.join(shipped_names())}")
    args.calibration = str(shipped) if shipped.is_file() else name
    origin = "given by --calibration" if args.calibration != str(shipped_calibration(GPUS[gpu][1])) \
        else f"measured on the {gpu.upper()} ({how})"
    return f"calibration: {Path(args.calibration).name}, {origin}"


def parse_args(argv, prog=None):
    parser = argparse.ArgumentParser(
        prog=prog or "plan_layout.py", description=__doc__.split("\n\n")[0], fromfile_prefix_chars="@")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workload", choices=sorted(PRESETS), help="a preset workload")
    source.add_argument("--workload-file", metavar="FILE", help="a workload JSON file (format above)")
    parser.add_argument("--gpus", type=int, help="GPU count (default: the preset's, else 8)")
    parser.add_argument("--gpu", choices=sorted(GPUS), help="the GPU model: its measured calibration and memory "
                        "(default: detected by nvidia-smi, else h200)")
    parser.add_argument("--gpu-memory-gb", type=float, metavar="G",
                        help=f"memory per GPU in GB of 1e9 bytes (default: the GPU's: H100 {H100_MEMORY_GB}, "
                             f"H200 {H200_MEMORY_GB})")
    parser.add_argument("--gpus-per-node", type=int, default=8, metavar="N", help="GPUs per node (default 8)")
    parser.add_argument("--calibration", metavar="NAME|FILE",
                        help="a calibration JSON file, or one shipped in megatron_hetero/planner/calibrations by "
                             "name (h100_measured, h200_measured, h200_x4_measured, h200: assumed figures); "
                             "default: the one measured on the GPU (--gpu)")
    parser.add_argument("--as-trained", action="store_true",
                        help="the preset as benchmarks/bench_e2e.py trains it (the trainer's MLPs 4 x hidden, its "
                             "padded vocabulary: a family's own, else the demo tokenizer's; its micro batch): "
                             "what bench_e2e's out-of-memory line plans")
    overrides = parser.add_argument_group("workload overrides")
    overrides.add_argument("--global-batch-size", dest="global_batch", type=int, metavar="N",
                           help="samples per step (default: the workload's)")
    overrides.add_argument("--micro-batch-size", dest="micro_batch", type=int, metavar="N",
                           help="fix the micro batch size (default: search)")
    overrides.add_argument("--global-batch", dest="global_batch", type=int, action=_Renamed, new="--global-batch-size")
    overrides.add_argument("--micro-batch", dest="micro_batch", type=int, action=_Renamed, new="--micro-batch-size")
    overrides.add_argument("--seq-length", type=int, metavar="N", help="the LLM's sequence length")
    overrides.add_argument("--llm-layers", type=int, metavar="N", help="the LLM's depth (bench_e2e's --llm-layers)")
    overrides.add_argument("--items-per-sample", type=int, metavar="N", help="images (clips) per sample, every encoder")
    overrides.add_argument("--freeze-encoders", action="store_true", help="encoders run forward only")
    overrides.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=None,
                           help="optimizer state sharded over data parallelism (Megatron's "
                                "--use-distributed-optimizer; default: the workload's)")
    overrides.add_argument("--allow-recompute", action=argparse.BooleanOptionalAction, default=None,
                           help="also try activation recomputation: the fewest layers of each stage that "
                                "fit (Megatron's --recompute-method block)")
    overrides.add_argument("--fused-mlp", action=argparse.BooleanOptionalAction, default=None,
                           help="dense MLPs (GELU; the LLM's SwiGLU) keep no activation output (quack's GEMM "
                                "epilogues: Hopper/Blackwell with the fa4 extra), the calls auto runs so "
                                "(MLP_MIN_MACS, spec/sizes.py)")
    overrides.add_argument("--fused-gated-bias-mlp", action=argparse.BooleanOptionalAction, default=None,
                           help="with --fused-mlp, a gated encoder MLP with fc1 biases (Qwen2.5-VL's ViT) too: "
                                "GPUs where `megatron-hetero kernels check mlp` passed (the H100 and H200)")
    overrides.add_argument("--grouped-experts", action=argparse.BooleanOptionalAction, default=None,
                           help="an MoE LLM's experts on torch's grouped GEMMs where auto runs them so (Hopper, "
                                "bf16, aligned widths; the trainer's default): their weight-gradient GEMM's "
                                "transient counted; --no-grouped-experts: SequentialMLP "
                                "(MEGATRON_HETERO_EXPERTS_KERNEL=sequential)")
    overrides.add_argument("--fused-cross-entropy", action=argparse.BooleanOptionalAction, default=None,
                           help="the loss on megatron-core's native fused cross entropy (Megatron's "
                                "--cross-entropy-loss-fusion): one more fp32 copy of the logits while it runs, "
                                "10 bytes per logit instead of 6")
    overrides.add_argument("--quack-cross-entropy", action=argparse.BooleanOptionalAction, default=None,
                           help="that fused loss on quack's cross entropy where it runs (the vocabulary not "
                                "split over TP; GPUs where `megatron-hetero kernels check loss` passed): "
                                "4 bytes per logit")
    parser.add_argument("--top", type=int, default=5, metavar="N", help="layouts to print (default 5)")
    parser.add_argument("--layouts", nargs="+", metavar="FILE", help="also predict these layout files")
    parser.add_argument("--write-yaml", metavar="FILE", help="write the best layout here")
    return parser.parse_args(argv)


def load_workload(args) -> tuple[Workload, str, int]:
    """(workload with the overrides applied, description, default GPU count)."""
    if args.workload:
        preset = PRESETS[args.workload]
        workload, description, gpus = preset.workload, f"{args.workload}: {preset.description}", preset.gpus
        if args.as_trained:
            workload, description = _as_trained(args), f"{description}, as bench_e2e trains it"
    elif args.as_trained:
        raise ValueError("--as-trained: give a preset (--workload), not a workload file")
    else:
        workload, description, gpus = Workload.load(args.workload_file), args.workload_file, 8
    encoder_changes = {}
    if args.items_per_sample is not None:
        encoder_changes["items_per_sample"] = args.items_per_sample
    if args.freeze_encoders:
        encoder_changes["frozen"] = True
    changes = {"encoders": tuple(replace(e, **encoder_changes) for e in workload.encoders)}
    llm_changes = {key: value for key, value in (("seq_length", args.seq_length), ("layers", args.llm_layers))
                   if value is not None}
    changes["llm"] = replace(workload.llm, **llm_changes)
    for key in ("global_batch", "micro_batch", "distributed_optimizer", "allow_recompute", "fused_mlp",
                "fused_gated_bias_mlp", "grouped_experts", "fused_cross_entropy", "quack_cross_entropy"):
        if getattr(args, key) is not None:
            changes[key] = getattr(args, key)
    return replace(workload, **changes), description, gpus


def _as_trained(args) -> Workload:
    """The preset in the planner's terms as bench_e2e's trainer builds it, at the depth and batch
    sizes given (bench_e2e's sized_workload)."""
    bench = BENCH_WORKLOADS.get(args.workload) or FAMILY_BENCH_WORKLOADS.get(args.workload)
    if bench is None:
        raise ValueError(f"--as-trained: bench_e2e does not train {args.workload}; drop the flag or use one of "
                         f"{', '.join(sorted([*BENCH_WORKLOADS, *FAMILY_BENCH_WORKLOADS]))}")
    bench = replace(resized_workload(bench, args.seq_length or 0, args.items_per_sample or 0),
                    layers=args.llm_layers or bench.layers,
                    global_batch=args.global_batch or bench.global_batch,
                    micro_batch=args.micro_batch or bench.micro_batch)
    return trainer_workload(bench, trainer_vocab_size(bench), bench.frozen)


def _gain(prediction, reference) -> str:
    """Throughput gain at the same GPU count and global batch: tokens/s and TFLOPS/GPU alike."""
    return f"{100 * (reference.step_s / prediction.step_s - 1):+.1f}%"


def print_table(title: str, predictions: list) -> None:
    print(title)
    print(f"{'#':>3}  {'placement':<14} {'layouts':<52} {'mb':>3} {'step s':>8} {'tokens/s':>9} "
          f"{'TFLOPS/GPU':>10} {'GB/GPU':>7}")
    for number, p in enumerate(predictions, 1):
        c = p.candidate
        print(f"{number:>3}  {c.placement:<14} {c.describe():<52} {c.micro_batch:>3} {p.step_s:>8.2f} "
              f"{p.tokens_per_s:>9,.0f} {p.tflops_per_gpu:>10.0f} {p.memory_gb:>7.0f}")
    for number, p in enumerate(predictions, 1):
        print(f"{number:>3}. {p.reason}")


def _report_gains(result, paper: bool):
    """Print the best homogeneous layout and each placement's predicted gain over it; return it."""
    reference = result.best("homogeneous")
    print()
    if reference is None:
        print("best homogeneous: none fits in memory; no gain to report")
        return None
    number = result.ranked.index(reference) + 1
    print(f"best homogeneous: #{number} {reference.candidate.describe()} (mb {reference.candidate.micro_batch}), "
          f"{reference.step_s:.2f} s/step, {reference.tflops_per_gpu:.0f} TFLOPS/GPU")
    for placement in ("colocated", "non_colocated"):
        best = result.best(placement)
        published = f"  (published: {PUBLISHED[placement]})" if paper else ""
        if best is None:
            print(f"predicted gain, best {placement}: none fits{published}")
        else:
            print(f"predicted gain, best {placement} over best homogeneous: {_gain(best, reference)} "
                  f"[{best.candidate.describe()}]{published}")
    return reference


def report(args) -> int:
    if args.top < 1:
        raise ValueError(f"--top {args.top}: print at least 1 layout")
    workload, description, default_gpus = load_workload(args)
    calibration_line = resolve_calibration(args)
    cluster = Cluster(default_gpus if args.gpus is None else args.gpus, args.gpu_memory_gb, args.gpus_per_node)
    calibration = Calibration.load(args.calibration)
    model = CostModel(workload, cluster, calibration)
    # Layout files first: a bad one stops the run before anything is printed.
    given = [(path, best_micro_batch(model, candidate_from_layout(load_layout(path, cluster.gpus), workload, cluster)))
             for path in args.layouts or []]
    result = plan(workload, cluster, calibration)
    capacity = cluster.gpu_memory_gb * calibration.usable_memory_fraction
    print(f"workload {description}")
    print("modules: " + ", ".join(
        f"{m.name} {module_params(m, workload.llm.hidden) / 1e9:.2f}B parameters, "
        f"{m.tokens_per_sample:,} tokens per sample{' (frozen)' if m.frozen else ''}"
        for m in workload.modules))
    print(f"cluster: {cluster.gpus} GPUs, {cluster.gpu_memory_gb:g} GB each ({capacity:.0f} GB usable), "
          f"{cluster.gpus_per_node} per node")
    print(f"{calibration_line} ({calibration.source})")
    print(f"PREDICTIONS from the cost model, not measurements: {len(result.ranked)} of "
          f"{len(result.ranked) + len(result.over_memory)} layouts fit in memory\n")
    if result.ranked:
        print_table(f"best {min(args.top, len(result.ranked))}:", result.ranked[:args.top])
    else:
        print("no layout fits in memory")
    reference = _report_gains(result, args.workload == "paper")
    if result.over_memory:
        print()
        print_table(f"fastest {min(3, len(result.over_memory))} over memory (each at its smallest-memory micro batch):",
                    result.over_memory[:3])
    if given:
        explained = [replace(p, reason=f"{path}: " + explain(p, reference, workload, capacity)) for path, p in given]
        print()
        print_table("given layouts (each at its fastest micro batch that fits, else its smallest-memory one), "
                    "fastest first:", sorted(explained, key=lambda p: p.step_s))
    if args.write_yaml:
        if not result.ranked:
            print("error: no layout fits in memory; nothing written", file=sys.stderr)
            return 1
        best = result.ranked[0]
        try:
            Path(args.write_yaml).write_text(layout_yaml(best, workload, cluster), encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"{args.write_yaml}: cannot write the layout: {exc.strerror or exc}") from None
        print(f"\nwrote {args.write_yaml}: #{result.ranked.index(best) + 1} {best.candidate.describe()}; "
              f"check it with megatron-hetero layout check {args.write_yaml} --world-size {cluster.gpus}")
    return 0


def main(argv=None, prog=None) -> int:
    args = parse_args(argv, prog)
    try:
        return report(args)
    except ValueError as error:  # LayoutError is a ValueError
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
