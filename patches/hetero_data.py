"""Global microbatches for every rank (megatron.training 0.19 `build_pretraining_data_loader`).

Modules split a microbatch differently (the LLM over its data-parallel ranks, each encoder over its
own), so under `--hetero-layout` every rank's loader yields the global microbatch i: the samples
microbatch i of every LLM data-parallel rank takes, in rank order (micro batch size x LLM dp samples,
the same samples and order upstream's sampler gives those ranks). Each module takes its share.
"""

import contextlib

from megatron.core import parallel_state
from megatron.training import get_args

from megatron_hetero.patches._patch import replace


@contextlib.contextmanager
def _one_data_parallel_rank(args, llm_dp: int):
    saved = (args.micro_batch_size, getattr(args, "eval_micro_batch_size", None),
             parallel_state.get_data_parallel_rank, parallel_state.get_data_parallel_world_size)
    args.micro_batch_size *= llm_dp
    if saved[1] is not None:
        args.eval_micro_batch_size *= llm_dp
    parallel_state.get_data_parallel_rank = lambda *a, **k: 0
    parallel_state.get_data_parallel_world_size = lambda *a, **k: 1
    try:
        yield
    finally:
        (args.micro_batch_size, eval_mbs, parallel_state.get_data_parallel_rank,
         parallel_state.get_data_parallel_world_size) = saved
        if eval_mbs is not None:
            args.eval_micro_batch_size = eval_mbs


def _build_loader(original):
    def build_pretraining_data_loader(dataset, consumed_samples):
        args = get_args()
        if args.hetero_run is None:
            return original(dataset, consumed_samples)
        with _one_data_parallel_rank(args, args.hetero_run.layout.llm.dp):
            return original(dataset, consumed_samples)
    return build_pretraining_data_loader


def apply() -> None:
    replace("megatron.training.training.build_pretraining_data_loader", _build_loader,
            params=("dataset", "consumed_samples"))
