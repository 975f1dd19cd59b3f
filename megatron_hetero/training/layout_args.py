"""`--hetero-layout` in Megatron's arguments: megatron-hetero's flags, and the layout as the source of
Megatron's parallel sizes (patches/arguments.py adds the flags to Megatron's parser and calls `load`
inside its validation).

The LLM's tp/cp/pp/sp/ep/etp become Megatron's `--tensor-model-parallel-size` & co. (a conflicting
flag is an error), the data-parallel size is the LLM's dp (microbatches are counted per LLM
data-parallel rank), and upstream validation sees the LLM's share of the world, so a non-colocated
layout whose encoder has ranks of its own validates. Every mistake is one `error:` line and exit
code 2, before any process group exists (`fail`).
"""

import os
import sys
from collections.abc import Callable

from megatron_hetero.boundary import BoundaryError, check_edge_layouts
from megatron_hetero.models import kernel_policy
from megatron_hetero.models.attention_kernels import check_policy
from megatron_hetero.spec import rules
from megatron_hetero.spec.layout import SCHEDULE_FLAG, ColocatedSchedule, HeteroLayout, LayoutError, load_layout


class ArgsError(ValueError):
    """A flag value that cannot work; one line naming the flag and the fix."""


def fail(message: str) -> None:
    """One line on rank 0, exit code 2 on every rank (all ranks validate the same arguments)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def add_hetero_flags(parser):
    """megatron-hetero's flags on `parser` (once: a parser that has them is returned as it is)."""
    if "--hetero-layout" in parser._option_string_actions:
        return parser
    group = parser.add_argument_group("megatron-hetero")
    group.add_argument("--hetero-layout", default=None, metavar="FILE",
                       help="YAML file declaring each module's parallel layout (megatron-hetero)")
    group.add_argument(SCHEDULE_FLAG, choices=tuple(ColocatedSchedule), default=ColocatedSchedule.RECOMPUTE.value,
                       help="colocated layouts with llm pp > 1: encoder forwards first, then the pipeline, "
                            "then each microbatch's encoder forward again with its backward (recompute); "
                            "every encoder forward, the pipeline, every encoder backward (three-phase); or "
                            "the encoder's work inside the pipeline's bubbles (bubbles)")
    group.add_argument("--metrics-file", default=None, metavar="FILE",
                       help="write one JSON object per iteration (step, loss, grad_norm, lr, ...) here; with "
                            "--timing-log-level 2 each rank's timeline beside it (megatron-hetero timeline)")
    group.add_argument("--hetero-heartbeat-interval", type=float, default=1.0, metavar="SECONDS",
                       help="each rank's heartbeat period on the job's store (a lost rank is named "
                            "within a few of them)")
    group.add_argument("--hetero-heartbeat-timeout", type=float, default=None, metavar="SECONDS",
                       help="a rank whose heartbeat stands still this long is lost (default: "
                            "--distributed-timeout-minutes)")
    return parser


# Megatron flag, args attribute, llm layout field, the flag's default.
_LLM_SIZES = (
    ("--tensor-model-parallel-size", "tensor_model_parallel_size", "tp", 1),
    ("--context-parallel-size", "context_parallel_size", "cp", 1),
    ("--pipeline-model-parallel-size", "pipeline_model_parallel_size", "pp", 1),
    ("--expert-model-parallel-size", "expert_model_parallel_size", "ep", 1),
    ("--expert-tensor-parallel-size", "expert_tensor_parallel_size", "etp", None),
)


def _apply_layout(args, layout: HeteroLayout) -> None:
    llm = layout.llm
    for flag, attr, axis, default in _LLM_SIZES:
        given, wanted = getattr(args, attr), getattr(llm, axis)
        if given not in (default, wanted):
            raise ArgsError(f"{flag} {given} conflicts with module {llm.name}'s {axis}={wanted} in "
                            f"{args.hetero_layout}; drop the flag (the layout file sets each module's sizes)")
        setattr(args, attr, wanted)
    if args.sequence_parallel and not llm.sp:
        raise ArgsError(f"--sequence-parallel conflicts with module {llm.name}'s sp: false in "
                        f"{args.hetero_layout}; set sp: true there or drop the flag")
    args.sequence_parallel = llm.sp
    # Megatron's own checks of these are asserts (a traceback): every script gets our line first.
    rules.check(ArgsError, rules.experts_problem(llm, args.num_experts, args.moe_router_topk),
                rules.colocated_schedule_problem(layout.placement, llm, args.hetero_colocated_schedule,
                                                 layout.encoders))
    if args.ddp_average_in_collective:
        # An encoder's gradients are scaled by 1 / the LLM's dp before a summing reduction.
        raise ArgsError("--ddp-average-in-collective is not supported with --hetero-layout yet; drop it")
    _checkpoint_flags(args)
    if args.num_layers_per_virtual_pipeline_stage or args.num_virtual_stages_per_pipeline_rank:
        raise ArgsError("virtual pipeline stages are not supported with --hetero-layout; drop "
                        "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank")


def _checkpoint_flags(args) -> None:
    """Checkpoints of a heterogeneous run are megatron-core distributed checkpoints whose every
    tensor is stored in a layout-independent form (patches/checkpointing.py)."""
    if (args.save or args.load) and args.ckpt_format != "torch_dist":
        raise ArgsError(f"--ckpt-format {args.ckpt_format} is not supported with --hetero-layout; use "
                        f"--ckpt-format torch_dist (the default)")
    for flag in ("async_save", "ckpt_fully_parallel_load", "non_persistent_save_interval"):
        if getattr(args, flag):
            raise ArgsError(f"--{flag.replace('_', '-')} is not supported with --hetero-layout yet; drop it")
    # Fully parallel saving splits the writes over the primary module's data-parallel group, which
    # does not hold every replica of another module's tensors.
    args.ckpt_fully_parallel_save = False
    # Megatron compares only the LLM's TP/PP sizes before loading the distributed optimizer's state;
    # an encoder's layout may change too: always the format that loads under any layout.
    args.dist_ckpt_optim_fully_reshardable = True


def check_kernels(args, head_dims: Callable[[], dict[str, int]]) -> kernel_policy.KernelPolicy:
    """The run's kernel policy from Megatron's --attention-backend, --flash-attention-version and
    --transformer-impl and the overrides (models/kernel_policy.py), checked against each module's
    attention head dim (head_dims(): module name -> head dim); ArgsError in one line for a bad value.
    Megatron's --cross-entropy-loss-fusion (native) too: its kernel hands the logits a bf16 gradient
    whatever their dtype (megatron-core 0.19), so it runs with --bf16 only."""
    import torch

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    if getattr(args, "cross_entropy_loss_fusion", False) and dtype != torch.bfloat16:
        raise ArgsError(f"--cross-entropy-loss-fusion rounds the logits' gradient to bf16 (megatron-core's native "
                        f"kernel); the model trains in {str(dtype).removeprefix('torch.')}: add --bf16 or drop "
                        f"--cross-entropy-loss-fusion")
    try:
        policy = kernel_policy.build(args.attention_backend, args.flash_attention_version, args.transformer_impl)
        check_policy(policy, head_dims, dtype)
    except kernel_policy.KernelPolicyError as error:
        raise ArgsError(str(error)) from None
    return policy


def load(args) -> HeteroLayout:
    """The layout of `--hetero-layout`, checked, with Megatron's sizes taken from it."""
    try:
        layout = load_layout(args.hetero_layout, args.world_size)
        for encoder in layout.encoders:
            check_edge_layouts(encoder, layout.llm)
        _apply_layout(args, layout)
    except (LayoutError, ArgsError, BoundaryError) as error:
        fail(str(error))
    return layout
