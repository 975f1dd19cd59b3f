"""The one place where megatron-core is adapted to run without CUDA (gloo on CPU).

megatron-core places buffers on `torch.cuda.current_device()`, keeps its RNG tracker on the CUDA
generator, slices RoPE tables for context parallelism with CUDA index tensors and moves a tied
embedding to the GPU to sync the pipeline ends' copies. Without CUDA these are redirected to the
CPU; with CUDA this module does nothing.
The distributed optimizer's collectives (coalesced reduce_scatter_tensor and all_gather_into_tensor
on flat buffers) run on gloo as they are (gloo has had them since about torch 2.3).
"""

import contextlib

import torch

from megatron_hetero.models.context_parallel import cp_slice

_applied = False


def _cpu_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """megatron-core's version pins host memory and copies indices to CUDA."""
    return cp_slice(pos_emb, seq_dim, cp_group.size(), cp_group.rank())


class _HostStream:
    """CPU work is ordered already: stream waits are no-ops."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


@contextlib.contextmanager
def _tensor_cuda_stays_on_host():
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = cuda


def _on_host(method):
    """`method` with Tensor.cuda() returning the tensor itself while it runs."""

    def wrapped(*args, **kwargs):
        with _tensor_cuda_stays_on_host():
            return method(*args, **kwargs)

    return wrapped


def apply_cpu_compat() -> None:
    """Redirect megatron-core's CUDA assumptions to the CPU when no GPU is present (idempotent)."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel import random as mcore_random

    # Buffers (DDP grad buffers, the global memory buffer, ...) are created on current_device().
    torch.cuda.current_device = lambda: "cpu"
    # DDP's gradient sync orders itself after the current stream.
    torch.cuda.current_stream = lambda *args, **kwargs: _HostStream()
    # The RNG tracker saves, seeds and restores "the CUDA generator": make that the CPU one.
    torch.cuda.get_rng_state = _cpu_rng_state
    torch.cuda.set_rng_state = _set_cpu_rng_state
    torch.cuda.manual_seed = torch.manual_seed
    mcore_random._get_cuda_rng_state = _cpu_rng_state
    mcore_random._set_cuda_rng_state = _set_cpu_rng_state
    # RoPE with CP slices the rotary table to the rank's load-balanced chunks.
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
    # Tied embeddings with PP: the last stage's copy is all-reduced from the first's after .cuda().
    LanguageModule.setup_embeddings_and_output_layer = _on_host(LanguageModule.setup_embeddings_and_output_layer)
    _applied = True
