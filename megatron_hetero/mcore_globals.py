"""The process-global state megatron-core insists on, set in this one place.

Module groups never live here: only the memory buffer local attention borrows from, and the RNG
tracker (used for dropout inside TP regions; weights are initialized from per-module seeds).
"""

from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed


def init_mcore_globals(seed: int, tp_rank: int) -> None:
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
    model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0)
