"""Megatron's argument parsing and validation, with megatron-hetero's flags (megatron.training 0.19:
`arguments.add_megatron_arguments`, `arguments.validate_args`).

- Our flags join Megatron's parser, so every script that parses Megatron's arguments takes them.
- Before upstream validation: fused kernels that need apex/TE default off without them; on CPUs the
  distributed backend defaults to gloo; with `--hetero-layout`, the layout decides the parallel
  sizes (hetero_args.py). Without `--hetero-layout` validation is upstream's.
"""

import torch

from megatron_hetero.patches import hetero_args, startup
from megatron_hetero.patches._patch import replace
from megatron_hetero.schedules.colocated_order import SCHEDULES


def add_hetero_flags(parser):
    group = parser.add_argument_group("megatron-hetero")
    group.add_argument("--hetero-layout", default=None, metavar="FILE",
                       help="YAML file declaring each module's parallel layout (megatron-hetero)")
    group.add_argument("--hetero-colocated-schedule", choices=SCHEDULES, default="recompute",
                       help="colocated layouts with llm pp > 1: encoder forwards first, then the pipeline, "
                            "then each microbatch's encoder forward again with its backward (recompute); "
                            "every encoder forward, the pipeline, every encoder backward (three-phase); or "
                            "the encoder's work inside the pipeline's bubbles (bubbles)")
    group.add_argument("--metrics-file", default=None, metavar="FILE",
                       help="write one JSON object per iteration (step, loss, grad_norm, lr, ...) here")
    group.add_argument("--hetero-heartbeat-interval", type=float, default=1.0, metavar="SECONDS",
                       help="each rank's heartbeat period on the job's store (a lost rank is named "
                            "within a few of them)")
    group.add_argument("--hetero-heartbeat-timeout", type=float, default=None, metavar="SECONDS",
                       help="a rank whose heartbeat stands still this long is lost (default: "
                            "--distributed-timeout-minutes)")
    return parser


def _add_megatron_arguments(original):
    def add_megatron_arguments(parser):
        return add_hetero_flags(original(parser))
    return add_megatron_arguments


def _validate_args(original):
    def validate_args(args, defaults={}):
        startup.disable_unavailable_fusions(args)
        if not torch.cuda.is_available() and args.distributed_backend == "nccl":
            args.distributed_backend = "gloo"
        args.hetero_run = None  # built once torch.distributed is up (patches/hetero_init.py)
        if getattr(args, "hetero_layout", None) is None:
            args.hetero_layout_spec = None
            return original(args, defaults)
        if getattr(args, "hetero_layout_spec", None) is None:  # a script's own checks may have loaded it
            args.hetero_layout_spec = hetero_args.load(args)
        return hetero_args.validate(original, args, defaults)
    return validate_args


def apply() -> None:
    replace("megatron.training.arguments.add_megatron_arguments", _add_megatron_arguments)
    replace("megatron.training.arguments.validate_args", _validate_args, params=("args", "defaults"))
