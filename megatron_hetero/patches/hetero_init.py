"""Per-module process groups instead of one global parallel layout (megatron.training 0.19
`initialize._initialize_distributed`).

With `--hetero-layout`, torch.distributed starts as upstream starts it, upstream's model-parallel
initialization is skipped, every module's groups are built from the layout (megatron-core
HyperCommGrid), and megatron-core's parallel_state is pointed at this rank's primary module
(parallel/parallel_state.py). The run's state (`args.hetero_run`) is built here, once.
"""

from megatron.training import get_args

from megatron_hetero.parallel import parallel_state
from megatron_hetero.parallel.context import build_run
from megatron_hetero.patches import faults
from megatron_hetero.patches._patch import replace


def _initialize_distributed(original):
    def initialize_distributed(get_embedding_ranks, get_position_embedding_ranks, store,
                               skip_model_parallel_init=False):
        args = get_args()
        if args.hetero_layout_spec is None:
            return original(get_embedding_ranks, get_position_embedding_ranks, store,
                            skip_model_parallel_init=skip_model_parallel_init)
        original(get_embedding_ranks, get_position_embedding_ranks, store, skip_model_parallel_init=True)
        args.hetero_run = build_run(args.hetero_layout_spec, args.hetero_colocated_schedule)
        parallel_state.point_at(args.hetero_run.primary.pgs)
        parallel_state.count_samples_over(args.hetero_layout_spec.llm.dp)
        faults.start(args)
    return initialize_distributed


def apply() -> None:
    replace("megatron.training.initialize._initialize_distributed", _initialize_distributed,
            params=("get_embedding_ranks", "get_position_embedding_ranks", "store", "skip_model_parallel_init"))
