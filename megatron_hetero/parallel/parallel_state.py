"""megatron-core's process-global parallel state, pointed at one module's groups (parallel_state 0.19).

A heterogeneous run has no single parallel layout: every module has its own groups (explicit
arguments everywhere in megatron-hetero). Megatron-LM's scripts and parts of megatron.training still
read `parallel_state` (the tensor-parallel broadcast of a batch, `is_pipeline_first_stage()` in a
model provider, data-parallel rank and size, checkpoint file names). Each rank's global state is set
to its primary module's groups (the LLM where it holds it, else its encoder), so those reads mean
"this rank in the module it serves". Code that runs megatron-core modules outside megatron.training
(tools, tests) sets the little they need with `init_outside_training`. This is the only place that
writes megatron-core's globals.
"""

import contextlib

import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

# parallel_state global -> ProcessGroupCollection field (and the global that lists its ranks).
_GROUPS = {
    "_TENSOR_MODEL_PARALLEL_GROUP": ("tp", "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS"),
    "_PIPELINE_MODEL_PARALLEL_GROUP": ("pp", "_PIPELINE_GLOBAL_RANKS"),
    "_MODEL_PARALLEL_GROUP": ("mp", "_MODEL_PARALLEL_GLOBAL_RANKS"),
    "_DATA_PARALLEL_GROUP": ("dp", "_DATA_PARALLEL_GLOBAL_RANKS"),
    "_DATA_PARALLEL_GROUP_WITH_CP": ("dp_cp", "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP"),
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": ("dp_cp", None),
    # Weight-remat (GTP) axes have size 1 here: the groups "with GTP remat" are the plain ones.
    "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": ("dp", None),
    "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": ("dp_cp", None),
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": ("dp_cp", None),
    "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": ("expt_dp", None),
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": ("expt_dp", None),
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": ("expt_dp", None),
    "_CONTEXT_PARALLEL_GROUP": ("cp", "_CONTEXT_PARALLEL_GLOBAL_RANKS"),
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": ("tp_cp", None),
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": ("tp_dp_cp", None),
    "_EMBEDDING_GROUP": ("embd", "_EMBEDDING_GLOBAL_RANKS"),
    "_POSITION_EMBEDDING_GROUP": ("pos_embd", "_POSITION_EMBEDDING_GLOBAL_RANKS"),
    "_EXPERT_MODEL_PARALLEL_GROUP": ("ep", "_EXPERT_MODEL_PARALLEL_RANKS"),
    "_EXPERT_TENSOR_PARALLEL_GROUP": ("expt_tp", None),
    "_EXPERT_DATA_PARALLEL_GROUP": ("expt_dp", None),
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": ("tp_ep", None),
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": ("tp_ep_pp", None),
}


def point_at(pgs: ProcessGroupCollection) -> None:
    """Make megatron-core's parallel_state answer with `pgs` on this rank."""
    for name, (field, ranks_name) in _GROUPS.items():
        group = getattr(pgs, field, None)
        setattr(ps, name, group)
        if ranks_name is not None:
            setattr(ps, ranks_name, dist.get_process_group_ranks(group) if group is not None else None)
    _ensure_memory_buffer()


def count_samples_over(llm_dp: int) -> None:
    """megatron.training counts consumed samples (the data position a checkpoint stores) as
    parallel_state's data-parallel world size x micro batch x microbatches, on every rank: in a
    heterogeneous run that size is the LLM's dp everywhere, also on ranks serving only an encoder,
    whose own data-parallel group has another size. (megatron-core reads no other size from here.)"""
    ps._MPU_DATA_PARALLEL_WORLD_SIZE = llm_dp


@contextlib.contextmanager
def pointed_at(pgs: ProcessGroupCollection, then: ProcessGroupCollection):
    """parallel_state answering with `pgs` inside, with `then` after: megatron-core's checkpoint code
    falls back to it for submodules without group attributes of their own, and a rank's other
    modules must not be saved with its primary module's tensor-parallel or data-parallel rank."""
    point_at(pgs)
    try:
        yield
    finally:
        point_at(then)


def _ensure_memory_buffer() -> None:
    if ps._GLOBAL_MEMORY_BUFFER is None:  # megatron-core's local attention borrows from it
        ps._set_global_memory_buffer()


def init_outside_training(seed: int, tp_rank: int) -> None:
    """What megatron-core modules need when they run without megatron.training's initialization:
    the memory buffer, and the tensor-parallel RNG tracker seeded for this TP rank (dropout inside
    TP regions; weights come from the builders' own seeds). Module groups are never set here."""
    _ensure_memory_buffer()
    model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0)
