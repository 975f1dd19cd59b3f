"""Pretrain a vision encoder + LLM with per-module layouts (megatron-hetero).

    torchrun --nproc-per-node 4 examples/pretrain_vlm.py --hetero-layout examples/layouts/demo_colocated.yaml \
        --train-iters 100 --global-batch-size 32 --micro-batch-size 4 --lr 1e-3 --eval-samples 64
"""

import os
import sys

from megatron_hetero.boundary import BoundaryError, BoundaryMismatch, check_edge_layouts
from megatron_hetero.layout import LayoutError, load_layout
from megatron_hetero.training.args import ArgsError, build_parser, check_args, check_trainable


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        # Everything a user can get wrong is checked before any process group exists.
        layout = load_layout(args.hetero_layout, world_size)
        check_trainable(layout)
        for encoder in layout.encoders:
            check_edge_layouts(encoder, layout.llm)
        check_args(args, layout)
    except (LayoutError, ArgsError, BoundaryError) as error:
        if rank == 0:
            print(f"error: {error}", file=sys.stderr)
        return 2

    import torch.distributed as dist

    from megatron_hetero.training.trainer import init_distributed, log, train

    device = init_distributed()
    log(rank, layout.rank_map())
    try:
        train(args, layout, device)
    except BoundaryMismatch as error:  # raised on every rank at once, with the same line
        if rank == 0:
            print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
