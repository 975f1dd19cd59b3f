"""Megatron's argument parsing and validation, with megatron-hetero's flags (megatron.training 0.19:
`arguments.add_megatron_arguments`, `arguments.validate_args`).

- Our flags (training/layout_args.py) join Megatron's parser, so every script that parses Megatron's
  arguments takes them; a bare % in an upstream help text is escaped, so that --help prints.
- Before upstream validation: `--save` without a positive `--save-interval` is one line naming the
  fix (upstream: a bare AssertionError); fused kernels that need apex/TE default off without them; on CPUs the
  distributed backend defaults to gloo; with `--hetero-layout`, the layout decides the parallel
  sizes (layout_args.load) and upstream validation runs over the LLM's ranks: data-parallel size =
  the LLM's dp. Without `--hetero-layout` validation is upstream's.
- With `--hetero-layout`, the kernel policy (models/kernel_policy.py) is built from Megatron's flags
  and the overrides, checked (a bad value: the same one line from every script) and printed on rank 0;
  the layers take it from their configs, which carry the same flags (training/providers.py).
"""

import os
import re

import torch

from megatron_hetero.patches import startup
from megatron_hetero.patches._patch import replace
from megatron_hetero.training.layout_args import ArgsError, add_hetero_flags, check_kernels, fail, load

# A % that starts no argparse field (%(default)s, a literal %%): megatron-core 0.19 documents
# --moe-paged-stash-buffer-size-factor-cuda with one.
_BARE_PERCENT = re.compile(r"(?<!%)%(?![(%])")


def _add_megatron_arguments(original):
    def add_megatron_arguments(parser):
        parser = add_hetero_flags(original(parser))
        for action in parser._actions:
            if action.help:  # argparse formats help with %: a bare one upstream breaks --help
                action.help = _BARE_PERCENT.sub("%%", action.help)
        return parser
    return add_megatron_arguments


def _validate_over_llm(original, args, defaults) -> None:
    """Upstream validation over the LLM's ranks: data-parallel size = the LLM's dp."""
    layout = args.hetero_layout_spec
    world_size = args.world_size
    args.world_size = layout.llm.size
    try:
        original(args, defaults)
    finally:
        args.world_size = world_size
    assert args.data_parallel_size == layout.llm.dp, (args.data_parallel_size, layout.llm.dp)


def _check_kernel_policy(args) -> None:
    """The run's kernel policy, checked against the LLM's head dim from Megatron's flags (a script's
    own checks may have built it with every module's), and its line printed on rank 0."""
    if getattr(args, "hetero_kernel_policy", None) is None:
        head_dim = args.kv_channels or args.hidden_size // args.num_attention_heads
        try:
            args.hetero_kernel_policy = check_kernels(args, lambda: {args.hetero_layout_spec.llm.name: head_dim})
        except ArgsError as error:
            fail(str(error))
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"kernel policy: {args.hetero_kernel_policy}", flush=True)


def _validate_args(original):
    def validate_args(args, defaults={}):
        if args.save is not None and not (args.save_interval or 0) > 0:
            fail(f"--save {args.save} needs --save-interval N (> 0), the iterations between checkpoints; "
                 f"add it, or drop --save")
        startup.disable_unavailable_fusions(args)
        if not torch.cuda.is_available() and args.distributed_backend == "nccl":
            args.distributed_backend = "gloo"
        args.hetero_run = None  # built once torch.distributed is up (patches/hetero_init.py)
        if getattr(args, "hetero_layout", None) is None:
            args.hetero_layout_spec = None
            return original(args, defaults)
        if getattr(args, "hetero_layout_spec", None) is None:  # a script's own checks may have loaded it
            args.hetero_layout_spec = load(args)
        _check_kernel_policy(args)
        return _validate_over_llm(original, args, defaults)
    return validate_args


def apply() -> None:
    replace("megatron.training.arguments.add_megatron_arguments", _add_megatron_arguments, params=("parser",))
    replace("megatron.training.arguments.validate_args", _validate_args, params=("args", "defaults"))
