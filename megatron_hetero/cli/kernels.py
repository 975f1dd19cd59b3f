"""`megatron-hetero kernels check`: is each fast kernel the layers may choose right on this GPU?

    megatron-hetero kernels check [attention|cp-chunks|norms|mlp|experts|loss|triton|all] [--quick] [--record]
                                  [--out DIR]

The layers run flash-attn-4 only at head dims checked on that GPU model, and context parallelism's
merged-chunk cuDNN attention, quack's cross entropy for the loss, our Triton kernel for short segments
and quack's epilogues for a gated MLP with fc1 biases only on GPU models checked for them
(models/kernel_policy.py: the table shipped with the package, and the user's). On another GPU, run the
check there: it prints the environment line that enables what passed
(MEGATRON_HETERO_FA4_CHECKED_HEAD_DIMS=..., MEGATRON_HETERO_CUDNN_MERGE_CHECKED=1,
MEGATRON_HETERO_LOSS_KERNEL=quack, ...), or with --record writes it into the user's table
(~/.cache/megatron_hetero/kernel_checks.json, or the file MEGATRON_HETERO_KERNEL_CHECKS names),
which the kernel policy reads from then on. The norms and MLP checks judge quack's kernels, which
the default runs on sm90 and sm100 GPUs; the experts check torch's grouped GEMMs for MoE experts,
which the default runs on sm90 GPUs; the triton check our Triton kernels for the layers' elementwise work
against the paths they stand in for. Each check's module docstring (cli/checks/) says what it
measures. Exit status: 0 PASS, 1 FAIL, 2 no GPU or the kernels do not load (one line saying which).
"""

import argparse
import importlib
import os
import sys

import torch

# Each check: its module (imported when it runs) and what it checks.
CHECKS = {
    "attention": ("megatron_hetero.cli.checks.attention",
                  "flash-attn-4 per head dim, and our attention at the workloads' shapes"),
    "cp-chunks": ("megatron_hetero.cli.checks.cp_chunks", "context parallelism's merged-chunk cuDNN attention"),
    "norms": ("megatron_hetero.cli.checks.norms", "quack's LayerNorm and RMSNorm"),
    "mlp": ("megatron_hetero.cli.checks.mlp", "the MLP's fused GEMMs (quack's epilogues)"),
    "experts": ("megatron_hetero.cli.checks.experts", "an MoE layer's grouped expert GEMMs and its host syncs"),
    "loss": ("megatron_hetero.cli.checks.loss", "quack's cross entropy for the LLM's loss"),
    "triton": ("megatron_hetero.cli.checks.triton", "our Triton kernels for the adds, the bias-GELU, the attention "
               "input and the small norms"),
}


def parse_args(argv=None, prog=None) -> argparse.Namespace:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=raw)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="run the kernel checks on this GPU", description=__doc__,
                                formatter_class=raw)
    check.add_argument("what", nargs="?", choices=[*CHECKS, "all"], default="all",
                       help="; ".join(f"{name}: {what}" for name, (_, what) in CHECKS.items()) + " (default: all)")
    check.add_argument("--quick", action="store_true", help="smaller shapes, fewer timing calls")
    check.add_argument("--record", action="store_true",
                       help="write what passed (attention, cp-chunks, loss, mlp) into the user's table of checked "
                            "kernels")
    check.add_argument("--workload-only", action="store_true",
                       help="attention: skip the raw kernel per head dim (needs a table entry for this GPU)")
    check.add_argument("--out", default=os.environ.get("OUT", "out"),
                       help="where the records (JSON lines) go (default: $OUT, else out/)")
    return parser.parse_args(argv)


def run_check(name: str, args: argparse.Namespace) -> int:
    """One check's exit status."""
    module = importlib.import_module(CHECKS[name][0])
    if name == "attention":
        return module.main(args.quick, args.out, args.record, args.workload_only)
    if name == "cp-chunks":
        return module.main(args.quick, args.record)
    if name in ("loss", "mlp"):
        return module.main(args.quick, args.out, args.record)
    return module.main(args.quick, args.out)


def main(argv=None, prog=None) -> int:
    args = parse_args(argv, prog)
    if not torch.cuda.is_available():
        print("error: no GPU visible: the kernel checks measure this GPU's kernels; run them on a GPU machine",
              file=sys.stderr)
        return 2
    names = list(CHECKS) if args.what == "all" else [args.what]
    status = {}
    for name in names:
        if len(names) > 1:
            print(f"== {name}: {CHECKS[name][1]}", flush=True)
        status[name] = run_check(name, args)
    if len(names) > 1:
        print("; ".join(f"{name} {('PASS', 'FAIL', 'not run')[code]}" for name, code in status.items()))
    return max(status.values())


if __name__ == "__main__":
    sys.exit(main())
