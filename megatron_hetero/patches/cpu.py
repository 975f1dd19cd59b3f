"""Megatron on CPUs (gloo): megatron-core and megatron.training assume CUDA in a few dozen places.

Active only while no GPU is present (apply() does nothing with CUDA). Targets megatron-core 0.19:
- `device='cuda'` / `.cuda()` sites (optimizers, clip_grads, schedules, training loop, data broadcast):
  one TorchFunctionMode sends them to the CPU, and answers `tensor.type()` as CUDA would, for the
  `== 'torch.cuda.FloatTensor'` checks in the optimizers;
- `torch.cuda.current_device/synchronize/Stream/stream/Event`: buffers and timers get the CPU and
  no-op stream ordering (CPU work is ordered already);
- the CUDA RNG the tensor-parallel RNG tracker saves, seeds and restores: the CPU generator;
- RoPE with CP slices its table with CUDA index tensors;
- the distributed init and the seeding skip model-parallel setup when no GPU is counted: they see one;
- the JIT warm-up's random "CUDA" tensors must not draw from the CPU generator weights come from;
- process groups asked for by backend name (MIMO's bridge communicators want "nccl") are created on
  the default backend, gloo;
- the MoE all-to-all dispatcher's token counts: megatron-core copies CUDA counts to host numpy arrays
  (the split sizes all_to_all_single takes) and leaves host tensors as they are, which it refuses;
- its gather and reduce-scatter of unevenly split tokens over expert-tensor-parallel ranks: gloo
  gathers only equal sizes (padded here to the largest split) and reduce-scatters none (an
  all-reduce and this rank's rows here);
- Megatron's pretrain never destroys its process groups: gloo's worker threads, still alive when
  the interpreter ends, then now and then abort a run that ended well ("terminate called without
  an active exception", exit -6; pytorch/pytorch#190489). They are destroyed at exit, as torch
  asks, unless an exception ended the run (a peer may still be inside a collective).
"""

import atexit
import contextlib
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megatron_hetero.patches._patch import PASS_THROUGH, applied, enter, replace, temporarily


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """device='cuda' -> cpu; tensor.cuda() -> the tensor; tensor.type() names the CUDA type."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _HostStream:
    """A CUDA stream on the host: work is ordered already."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return event or _HostEvent()


class _HostEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _cpu_rng_state(original):
    return lambda *args, **kwargs: torch.get_rng_state()


def _set_cpu_rng_state(original):
    def set_rng_state(new_state: torch.Tensor, *args, **kwargs) -> None:
        torch.set_rng_state(new_state)
    return set_rng_state


def _one_device_counted():
    """megatron.training's distributed init and seeding set up model parallelism only when a GPU is
    counted: let them count one, and make selecting it a no-op."""
    stack = contextlib.ExitStack()
    stack.enter_context(temporarily("torch.cuda.device_count", lambda original: lambda: 1, PASS_THROUGH))
    stack.enter_context(temporarily("torch.cuda.set_device", lambda original: lambda device: None, ("device",)))
    return stack


def _keeping_cpu_rng(original):
    """The JIT warm-up draws random CUDA tensors: on the CPU they would come from the generator that
    --use-cpu-initialization initializes weights from, in TP-size-dependent amounts."""
    def wrapper(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return original(*args, **kwargs)
    return wrapper


def _host_split_sizes(original):
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy, record_stream)
    return maybe_move_tensor_to_cpu


def _uneven_gather(original):
    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])
    return gather_along_first_dim


def _uneven_reduce_scatter(original):
    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        total = input_.clone()
        dist.all_reduce(total, group=group)
        return torch.split(total, [int(n) for n in input_split_sizes])[group.rank()].contiguous()
    return reduce_scatter_along_first_dim


def _on_default_backend(create):
    def wrapper(*args, backend=None, **kwargs):
        return create(*args, **kwargs)
    return wrapper


def _counting_one_device(original):
    def wrapper(*args, **kwargs):
        with _one_device_counted():
            return original(*args, **kwargs)
    return wrapper


MODE = "torch functions: device='cuda' -> cpu, tensor.cuda(), tensor.type() (a TorchFunctionMode)"
_MODE = _CudaToCpu()


def destroy_groups_at_clean_exit() -> None:
    """An exit function: the process groups destroyed unless an uncaught exception ends the run
    (the interpreter records it as sys.last_exc before it runs the exit functions)."""
    if dist.is_initialized() and getattr(sys, "last_exc", None) is None:
        dist.destroy_process_group()


# torch.cuda's functions and classes on the host: (target, replacement maker, params or kind).
_HOST_CUDA = (
    ("current_device", lambda original: lambda: "cpu", PASS_THROUGH),
    ("current_stream", lambda original: lambda *args, **kwargs: _HostStream(), PASS_THROUGH),
    ("default_stream", lambda original: lambda *args, **kwargs: _HostStream(), PASS_THROUGH),
    ("Stream", lambda original: _HostStream, type),
    ("Event", lambda original: _HostEvent, type),
    ("stream", lambda original: lambda stream=None: contextlib.nullcontext(), ("stream",)),
    ("synchronize", lambda original: lambda *args, **kwargs: None, PASS_THROUGH),
    ("get_rng_state", _cpu_rng_state, PASS_THROUGH),
    ("set_rng_state", _set_cpu_rng_state, ("new_state",)),
    ("manual_seed", lambda original: lambda seed: torch.default_generator.manual_seed(int(seed)), ("seed",)),
    ("manual_seed_all", lambda original: lambda seed: None, ("seed",)),  # torch.manual_seed: after the CPU's
)


def _cp_slice_on_host(original):
    from megatron_hetero.models.context_parallel import cp_slice

    return lambda pos_emb, seq_dim, cp_group: cp_slice(pos_emb, seq_dim, cp_group.size(), cp_group.rank())


def _megatron_on_host() -> None:
    """megatron-core's and megatron.training's CUDA-only calls (see the module docstring)."""
    random = "megatron.core.tensor_parallel.random"
    replace(f"{random}._get_cuda_rng_state", _cpu_rng_state, PASS_THROUGH)
    replace(f"{random}._set_cuda_rng_state", _set_cpu_rng_state, ("new_state",))
    replace("megatron.core.models.common.embeddings.rotary_pos_embedding.get_pos_emb_on_this_cp_rank",
            _cp_slice_on_host, ("pos_emb", "seq_dim", "cp_group"))
    # Without a GPU there is no architecture to query: report one before Blackwell (no change of path).
    replace("megatron.training.arguments.get_device_arch_version", _no_architecture, PASS_THROUGH)
    replace("megatron.training.initialize._initialize_distributed", _counting_one_device, PASS_THROUGH)
    replace("megatron.training.initialize._set_random_seed", _counting_one_device, PASS_THROUGH)
    replace("megatron.training.initialize._warmup_jit_function", _keeping_cpu_rng, PASS_THROUGH)
    replace("megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu", _host_split_sizes,
            params=("tensor", "as_numpy", "record_stream"))
    replace("megatron.core.tensor_parallel.mappings._gather_along_first_dim", _uneven_gather,
            params=("input_", "group", "output_split_sizes", "use_global_buffer"))
    replace("megatron.core.tensor_parallel.mappings._reduce_scatter_along_first_dim", _uneven_reduce_scatter,
            params=("input_", "group", "input_split_sizes", "use_global_buffer"))


def _no_architecture(original):
    return lambda: 0


def apply() -> None:
    """Install the CPU redirections (idempotent; nothing with CUDA)."""
    if torch.cuda.is_available() or MODE in applied():
        return
    atexit.register(destroy_groups_at_clean_exit)  # before the watchdog's: it runs after it
    for name, make, check in _HOST_CUDA:
        replace(f"torch.cuda.{name}", make, **({"kind": check} if check is type else {"params": check}))
    _megatron_on_host()
    for name in ("new_group", "new_subgroups_by_enumeration"):
        replace(f"torch.distributed.{name}", _on_default_backend, ("backend",))
    enter(MODE, _MODE)  # for the life of the process
